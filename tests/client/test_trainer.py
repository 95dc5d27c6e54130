"""Hugging Face Trainer drives an attached model with a tierd optimizer, with
clipping and gradient accumulation, to the weights of the plain Trainer run."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd.optim
from tierd.client.attach import attach
from tierd.client.store import LocalStore
from tests.client.models import assert_same_weights, batches, llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")   # Trainer needs it (the "test" extra installs it)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _train(model, opt, tmp_path, rows) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=1.0, max_steps=3, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    transformers.Trainer(model=model, args=args, train_dataset=_Rows(rows),
                         optimizers=(opt, sched)).train()


def test_trainer_with_clipping_and_accumulation_matches_the_plain_trainer(tmp_path):
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    rows = [row for ids in batches(6, batch=2) for row in ids]   # 12 rows: 3 steps of 2x2
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False), tmp_path / "ref",
           rows)
    _train(model, tierd.optim.AdamW(model.parameters(), lr=1e-2), tmp_path / "tierd", rows)
    assert_same_weights(model, ref, atol=1e-5)
