"""A reward model: a Hugging Face sequence-classification directory that scores (prompt, transcript).

``[reward] model = "DIR"`` makes every reward worker load one and score each
episode with it instead of the environment's ``reward``. The score is the
model's single logit (``num_labels = 1``) for the prompt followed by the
transcript, encoded by the model's tokenizer with its special tokens and cut
from the front to the most tokens the model reads. A reward worker placed on a slot (``control.reward_on_slots``)
sees that slot's GPU as ``cuda:0`` (the node agent sets
``CUDA_VISIBLE_DEVICES``); without one it runs on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from workers.envs.base import RewardError, Task


class RewardModel:
    """Callable as a reward function: ``(task, transcript) -> float``."""

    def __init__(self, model_dir: str | Path, *, max_length: int | None = None, device: str | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_dir(model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model, info = AutoModelForSequenceClassification.from_pretrained(str(model_dir), output_loading_info=True)
        if info["missing_keys"]:   # e.g. a causal LM's directory: its score head would be drawn at random
            raise ValueError(f"reward.model = {str(model_dir)!r} lacks weights the model needs "
                             f"({', '.join(sorted(info['missing_keys'])[:4])}); they would score at random: "
                             "give a trained sequence-classification checkpoint")
        self.model = model.to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward.model = {str(model_dir)!r} has {self.model.config.num_labels} labels; "
                             "a reward model has one (a score)")
        self.max_length = max_length or _longest_input(self.tokenizer, self.model.config)
        self.tokenizer.truncation_side = "left"   # a long episode keeps its end, where the answer is

    @torch.no_grad()
    def __call__(self, task: Task, transcript: str) -> float:
        text = task.prompt + transcript
        if not text:
            raise RewardError("nothing to score: empty prompt and transcript")
        # As the model was trained to read it: with its special tokens (an encoder pools its [CLS], a
        # decoder starts at its BOS).
        enc = self.tokenizer(text, truncation=True, max_length=self.max_length)
        logits = self.model(**{k: torch.tensor([v], device=self.device) for k, v in enc.items()}).logits
        return float(logits[0, 0])


def check_dir(model_dir: str | Path) -> None:
    """What can be told of ``[reward] model`` without loading it; ValueError naming the setting.

    Its ``config.json`` must say a sequence classifier (``architectures``, where
    given) with one label: a causal LM's directory loads under
    ``AutoModelForSequenceClassification`` too, with a head of random weights.
    """
    where = f"reward.model = {str(model_dir)!r}"
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no config.json there (a Hugging Face model directory)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: config.json cannot be read ({exc})") from None
    archs = cfg.get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{where} is a {', '.join(archs)}, not a sequence classifier: a reward model scores "
                         "with a one-label head (*ForSequenceClassification)")
    labels = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else cfg.get("num_labels", 2)
    if labels != 1:
        raise ValueError(f"{where} has {labels} labels; a reward model has one (a score)")


# Models whose positions start after the padding index: their tables hold pad_token_id + 1 entries no text uses.
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer", "data2vec-text",
                     "bart", "mbart", "ibert", "roberta-prelayernorm"}


def _longest_input(tokenizer, config) -> int:
    """The most tokens the model reads: its tokenizer's limit where it states one, else its position table.

    RoBERTa-family position tables hold two entries the text cannot use (514
    for 512 tokens); their tokenizers usually state the usable 512, and where
    one does not the table is cut by those entries.
    """
    table = getattr(config, "max_position_embeddings", None)
    if isinstance(table, int) and getattr(config, "model_type", "") in _OFFSET_POSITIONS:
        pad = getattr(config, "pad_token_id", None)
        table -= (1 if pad is None else pad) + 1
    limits = [n for n in (table, tokenizer.model_max_length)
              if isinstance(n, int) and 0 < n < 1_000_000]   # a tokenizer with no limit states about 1e30
    return min(limits, default=4096)
