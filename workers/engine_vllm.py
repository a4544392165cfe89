"""The rollout engine: vLLM behind the episode loop's ``Generator`` protocol.

Who calls it: the rollout worker process (one engine per worker; ``generate``
through ``episode.run_episodes``, ``reload`` between groups when a new
policy version is published) and the evaluator (``episode.evaluate``).
With ``in_process=False``, construct it only under
``if __name__ == "__main__"`` (or in a worker's ``run``): vLLM then starts its
engine core with multiprocessing spawn, which re-imports the main module.

Behaviour log-probs are those of the distribution sampled from: sampling is
at ``temperature`` (rollout.temperature) with top-p 1, top-k off and no
penalties, and the engine runs with ``logprobs_mode="processed_logprobs"``,
so the returned log-probs are those of softmax(logits / temperature); the
learner scales its logits by the same 1 / temperature. Greedy requests
(evaluation) decode at temperature 0.

EOS: when the policy samples EOS, vLLM puts its id at the end of the output
token ids (and leaves it out of the text); we keep it, with its log-prob, as
``TorchGenerator`` does, and report finish "eos".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from workers.episode import TurnOutput

# Quiet by default; a worker that wants vLLM's INFO lines sets these itself.
ENV_DEFAULTS = {
    "VLLM_CONFIGURE_LOGGING": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}
# The tiny policy's KV cache takes ~1 KiB per token; 1 GiB holds ~10^6 tokens.
# An explicit size also lets vLLM skip its memory-profiling warmup.
DEFAULT_KV_CACHE_BYTES = 1 << 30


def _prepare_process(in_process: bool, threads: int | None) -> None:
    """Environment and threads, set before vLLM is imported (it reads them then)."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if in_process and threads is not None:
        torch.set_num_threads(threads)


class VLLMEngine:
    """A ``vllm.LLM`` on a policy directory; implements ``episode.Generator``.

    Processes and threads on a small CPU machine. ``in_process=True`` (the
    default) runs vLLM's engine in the calling process with ``threads`` torch
    threads: on 2 cores, one thread leaves the other core to a torch learner,
    the engine starts in ~8 s after imports (~30 s in all), and it samples
    ~5-6k policy tokens/s on groups of 256 episodes. vLLM then replaces
    ``torch.set_num_threads`` in this process with a no-op. With
    ``in_process=False`` vLLM spawns an engine-core and a worker process and
    binds the worker's OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND``,
    "auto": one core of two); same speed, ~30 s more to start.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        gpu_memory_utilization: float = 0.05,
        seed: int = 0,
        max_model_len: int = 256,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
        in_process: bool = True,
        threads: int | None = 1,
        enforce_eager: bool = True,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        temperature: float = 1.0,
        **llm_kwargs,
    ):
        _prepare_process(in_process, threads)
        from vllm import LLM  # imported late: vLLM reads its env vars at import

        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.temperature = temperature  # of sampled (non-greedy) requests
        self.llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
            # A chunked prefill samples a token and then discards it, and
            # rewinding a seeded CPU generator for that raises ("CPU Generator
            # does not use offset"): whole prefills keep per-request seeds usable.
            enable_chunked_prefill=False,
            # On CPU this is the share of RAM vLLM may claim; with an explicit
            # KV cache size it only gates a free-memory check at start. With
            # kv_cache_memory_bytes 0 (None to vLLM) the KV cache gets what this
            # share leaves after the weights and a profiling run.
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes or None,
            # Eager: torch.compile would take minutes on 2 cores for no gain here.
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            # Ignore generation_config.json: sampling settings come from here only.
            generation_config="vllm",
            disable_log_stats=True,
            **llm_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()

    def _params(self, greedy: bool, seed: int | None, max_tokens: int, stops: Sequence[str]):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            seed=seed,
            max_tokens=max_tokens,
            stop=list(stops),
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's log-prob only
            skip_special_tokens=True,
        )

    def generate(
        self,
        requests: list[list[int]],
        *,
        greedy: bool,
        seeds: list[int] | None,
        max_tokens: int,
        stops: Sequence[str],
    ) -> list[TurnOutput]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r)) for r in requests]
        params = [self._params(greedy, None if seeds is None else seeds[i], max_tokens, stops) for i in range(len(requests))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [_turn_output(o.outputs[0], self.tokenizer) for o in outputs]

    def reload(self, weights_dir: str | Path) -> None:
        """Load new weights in place, then drop the prefix cache built on the old ones."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
        self.model_dir = Path(weights_dir)


def _turn_output(completion, tokenizer) -> TurnOutput:
    """The turn as tokens, log-probs and the text of exactly those tokens.

    vLLM cuts ``completion.text`` at the stop string, but with a BPE tokenizer
    the token that completed it may carry more characters (``"</g>\n"``):
    the text is decoded from the token ids instead, so that text and ids never
    disagree (the environment parses up to the stop, ``envs.base.cut_at_stop``).
    """
    token_ids = list(completion.token_ids)
    # logprobs=0 gives, per position, a dict holding at least the sampled token.
    logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, token_ids)]
    if completion.finish_reason == "length":
        finish = "length"
    elif isinstance(completion.stop_reason, str):
        finish = "stop"
    else:
        # finish "stop" with no stop string: the EOS token ended it.
        finish = "eos"
    body = token_ids[:-1] if finish == "eos" and token_ids else token_ids
    text = tokenizer.decode(body, skip_special_tokens=True)
    return TurnOutput(token_ids, logprobs, text, finish)
