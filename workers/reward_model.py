"""A reward model: a Hugging Face sequence-classification directory that scores (prompt, transcript).

``[reward] model = "DIR"`` makes every reward worker load one and score each
episode with it instead of the environment's ``reward``. The score is the
model's single logit (``num_labels = 1``) for the prompt followed by the
transcript. A reward worker placed on a slot (``control.reward_on_slots``)
sees that slot's GPU as ``cuda:0`` (the node agent sets
``CUDA_VISIBLE_DEVICES``); without one it runs on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.envs.base import RewardError, Task


class RewardModel:
    """Callable as a reward function: ``(task, transcript) -> float``."""

    def __init__(self, model_dir: str | Path, *, max_length: int | None = None, device: str | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward.model = {str(model_dir)!r} has {self.model.config.num_labels} labels; "
                             "a reward model has one (a score)")
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", 4096)

    @torch.no_grad()
    def __call__(self, task: Task, transcript: str) -> float:
        ids = self.tokenizer.encode(task.prompt + transcript, add_special_tokens=False)[-self.max_length:]
        if not ids:
            raise RewardError("nothing to score: empty prompt and transcript")
        logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits
        return float(logits[0, 0])
