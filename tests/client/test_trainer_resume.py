"""A stock Hugging Face Trainer saves an attached model and its tierd
optimizer at step 4 and resumes in a new process with
``resume_from_checkpoint`` (no tierd call but attach and the optimizer):
the weights at step 8 are bitwise those of the uninterrupted run. Every run
is a real process on a real daemon; torch's plain Trainer is the reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import subprocess_env

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, SAVED_AT = 8, 4


def _run(kind: str, out: str, *, stop_at: int | None = None, resume: bool = False) -> None:
    """One Trainer run in this process (the test starts it as a child)."""
    import transformers
    from safetensors.torch import save_file

    import tierd
    import tierd.optim
    from tests.client.models import batches, llama

    class Rows(torch.utils.data.Dataset):
        rows = [row for ids in batches(16, batch=4) for row in ids]   # 64 rows: 8 steps of 4x2

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    model = llama(seed=7 if resume else 0)   # resuming takes the checkpoint's weights
    if kind == "tierd":
        model = tierd.attach(model, client=tierd.connect(os.environ["TIERD_SOCKET"]))
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=4,
        max_grad_norm=1.0, max_steps=STEPS, warmup_steps=2, lr_scheduler_type="linear",
        use_cpu=True, report_to=[], save_strategy="steps", save_steps=SAVED_AT,
        logging_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
    callbacks = []
    if stop_at is not None:   # the first run "dies" right after its checkpoint
        class Stop(transformers.TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                if state.global_step >= stop_at:
                    control.should_training_stop = True
        callbacks.append(Stop())
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(),
                                   optimizers=(opt, None), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVED_AT}")
                  if resume else None)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(out, "final.safetensors"))


def _child(tmp_path, daemon, kind: str, out, *extra: str) -> None:
    env = dict(subprocess_env(), TIERD_SOCKET=str(daemon.socket))
    done = subprocess.run([sys.executable, "-m", "tests.client.test_trainer_resume", kind,
                           str(out), *extra], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def test_trainer_resumes_from_its_checkpoint_in_a_new_process_bitwise(tmp_path, daemon):
    from safetensors.torch import load_file
    _child(tmp_path, daemon, "torch", tmp_path / "torch")
    _child(tmp_path, daemon, "tierd", tmp_path / "straight")
    _child(tmp_path, daemon, "tierd", tmp_path / "resumed", "stop")
    _child(tmp_path, daemon, "tierd", tmp_path / "resumed", "resume")
    torch_run = load_file(tmp_path / "torch" / "final.safetensors")
    straight = load_file(tmp_path / "straight" / "final.safetensors")
    resumed = load_file(tmp_path / "resumed" / "final.safetensors")
    assert straight.keys() == resumed.keys() == torch_run.keys()
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
        assert torch.equal(torch_run[name], value), name


if __name__ == "__main__":
    kind, out, *how = sys.argv[1:]
    _run(kind, out, stop_at=SAVED_AT if "stop" in how else None, resume="resume" in how)
