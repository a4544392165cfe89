"""How an episode's text becomes tokens: the prompt, and the environment's replies between model turns.

Called by the episode loop (``workers.episode``) and the warm start. Tokens go
in and come out: the prompt is rendered and tokenized once, each model turn
keeps the token ids the engine sampled, and each reply is rendered and
tokenized on its own and appended. The conversation is never re-rendered
through the chat template, which could change earlier tokens and leave the
sequence disagreeing with its log-probs (design.md, "Environments and tokens").

With a chat template (``ChatFormat.for_tokenizer`` finds one), the prompt is
the template's rendering of a user message with the generation prompt, and a
reply is the text that closes the assistant's message (found by rendering a
probe conversation once) followed by what the template appends for the reply
as a message of the environment's role and the next generation prompt. Both
are rendered by the template with their own text, since a template may change
a message's content (Llama 3's trims it). Without a template (the tiny
char-level policy), the prompt and the replies are plain text, as the
calculator's format expects.
"""

from __future__ import annotations

from dataclasses import dataclass

_USER = "\x00LIBRA-USER\x00"
_ASSISTANT = "\x00LIBRA-ASSISTANT\x00"
_REPLY = "\x00LIBRA-REPLY\x00"
# the probe conversation a reply is appended to: a user message and the assistant's answer
_HEAD = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]


@dataclass(frozen=True)
class ChatFormat:
    """Text around each part of an episode; all empty for plain text."""

    close_assistant: str = ""     # what ends the assistant's message when the model stopped at a stop string
    reply_before: str = ""        # before a reply: the start of the environment's message
    reply_after: str = ""         # after it: its end and the next generation prompt
    eos_text: str = ""            # the end-of-turn token's text, which close_assistant starts with
    reply_role: str = ""          # the role of the environment's messages
    closed_probe: str = ""        # the probe conversation up to its closed assistant message

    @property
    def chat(self) -> bool:
        return bool(self.closed_probe)

    @classmethod
    def for_tokenizer(cls, tokenizer, reply_role: str = "tool", use_template: bool | None = None) -> "ChatFormat":
        """The tokenizer's chat format (None: use its template if it has one), else plain text."""
        template = getattr(tokenizer, "chat_template", None)
        if use_template is False or (use_template is None and not template):
            return cls()
        if not template:
            raise ValueError("env.chat_template = \"on\" but the policy's tokenizer has no chat template")
        return cls._probe(tokenizer, reply_role)

    @classmethod
    def _probe(cls, tokenizer, reply_role: str) -> "ChatFormat":
        def render(messages, gen):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

        closed = render(_HEAD, False)
        replied = render(_HEAD + [{"role": reply_role, "content": _REPLY}], True)
        if not replied.startswith(closed) or _ASSISTANT not in closed or _REPLY not in replied:
            raise ValueError(f"the chat template does not render a {reply_role!r} reply after an assistant "
                             "message by appending; set env.reply_role to a role it supports")
        reply = replied[len(closed):]
        eos = tokenizer.eos_token or ""
        close = closed.split(_ASSISTANT, 1)[1]
        return cls(close_assistant=close,
                   reply_before=reply.split(_REPLY)[0], reply_after=reply.split(_REPLY)[1],
                   eos_text=eos if close.startswith(eos) else "", reply_role=reply_role, closed_probe=closed)

    # --- token ids -----------------------------------------------------------------------------

    def prompt_ids(self, tokenizer, prompt: str) -> list[int]:
        if not self.chat:
            return tokenizer.encode(prompt, add_special_tokens=False)
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def reply_ids(self, tokenizer, reply: str, turn_ended_by_eos: bool) -> list[int]:
        """The tokens inserted after a model turn: close its message (unless its EOS did), the reply."""
        close = self.close_assistant
        if turn_ended_by_eos and self.eos_text:
            close = close[len(self.eos_text):]
        return tokenizer.encode(close + self._reply_text(tokenizer, reply), add_special_tokens=False)

    def _reply_text(self, tokenizer, reply: str) -> str:
        """The reply as the template appends it after an assistant message, with the next generation prompt."""
        if not self.chat:
            return reply
        replied = tokenizer.apply_chat_template(_HEAD + [{"role": self.reply_role, "content": reply}],
                                                tokenize=False, add_generation_prompt=True)
        closed = self.closed_probe
        # a template that renders this reply otherwise than by appending: the probe's parts around it
        return replied[len(closed):] if replied.startswith(closed) else self.reply_before + reply + self.reply_after
