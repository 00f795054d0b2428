"""The forgetting monitor: the probe's loss, accuracy and KL equal direct computations (the
KL exactly when top_k covers the vocabulary, a lower bound below it), the Lightning callback
measures on schedule, logs, resumes its KL from the first start and refuses bad input, and
the Hugging Face callback reports through the Trainer."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from lightning_slsam import ForgettingMonitor, SAMMixin, SparseLayerSAM
from lightning_slsam.monitor import ForgettingProbe, reference_windows

VOCAB = 48


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))


def reference(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding: not predicted
    return [ids, {"input_ids": ids, "attention_mask": mask}]


def direct(model, before, batches):
    """Loss, accuracy and exact KL(before || model) over the predicted positions."""
    loss = correct = kl = 0.0
    n = 0
    for batch in batches:
        batch = batch if isinstance(batch, dict) else {"input_ids": batch}
        ids = batch["input_ids"]
        keep = torch.ones_like(ids[:, 1:], dtype=torch.bool)
        if "attention_mask" in batch:
            keep = batch["attention_mask"][:, 1:].bool()
        with torch.no_grad():
            now = F.log_softmax(model(ids)[:, :-1][keep], -1)
            then = F.log_softmax(before(ids)[:, :-1][keep], -1)
        targets = ids[:, 1:][keep]
        loss += F.nll_loss(now, targets, reduction="sum").item()
        correct += (now.argmax(-1) == targets).sum().item()
        kl += (then.exp() * (then - now)).sum().item()
        n += len(targets)
    return loss / n, correct / n, kl / n, n


def test_the_probe_equals_direct_computations_and_its_top_k_kl_is_a_lower_bound():
    torch.manual_seed(0)
    model = Tiny()
    before = Tiny()
    before.load_state_dict(model.state_dict())
    exact = ForgettingProbe(model, reference(), top_k=VOCAB)
    coarse = ForgettingProbe(model, reference(), top_k=4)
    exact.start()
    coarse.start()
    assert exact.measure()["kl"] == 0.0 and coarse.measure()["kl"] == 0.0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.train()
    got, low = exact.measure(), coarse.measure()
    loss, accuracy, kl, n = direct(model, before, reference())
    assert got["tokens"] == n == 3 * 9 * 2 - 3
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["accuracy"] == pytest.approx(accuracy)
    assert got["kl"] == pytest.approx(kl, rel=1e-4) and kl > 0.05
    assert 0 < low["kl"] < got["kl"]  # coarsening never raises a divergence
    assert model.training and all(p.grad is None for p in model.parameters())
    assert exact.seconds > 0


def test_reference_windows_and_bad_input():
    batches = reference_windows(range(1000), 50, 4, max_windows=10)
    assert [b.shape[0] for b in batches] == [4, 4, 2] and batches[1][0, 0] == 200
    with pytest.raises(ValueError, match="fewer than one window"):
        reference_windows(range(10), 50, 4)
    with pytest.raises(ValueError, match="top_k"):
        ForgettingProbe(Tiny(), reference(), top_k=0)
    with pytest.raises(ValueError, match="empty"):
        ForgettingProbe(Tiny(), [])
    with pytest.raises(ValueError, match=r"\[batch, length >= 2\]"):
        ForgettingProbe(Tiny(), [torch.zeros(5, dtype=torch.long)])
    with pytest.raises(ValueError, match="every_n_steps"):
        ForgettingMonitor(reference(), every_n_steps=0)
    with pytest.raises(TypeError, match="input_ids"):
        ForgettingMonitor([{"ids": torch.zeros(2, 3)}])


class LM(SAMMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Tiny()

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def fit(tmp_path, epochs, monitor, ckpt=None, name="run"):
    # 3 batches an epoch: the checkpoint after the first epoch (step 3) resumes exactly.
    data = torch.randint(0, VOCAB // 2, (24, 12), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=epochs, callbacks=[SparseLayerSAM(seed=0), monitor],
        logger=CSVLogger(tmp_path, name=name), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    module = LM()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt)
    return trainer, module


def test_the_lightning_monitor_measures_on_schedule_logs_and_resumes_from_the_first_start(
    tmp_path,
):
    straight = ForgettingMonitor(reference(), every_n_steps=3, top_k=VOCAB)
    _, module = fit(tmp_path, 2, straight)
    steps = [s for s, _ in straight.history]
    assert steps == [0, 3, 6]
    kls = [m["kl"] for _, m in straight.history]
    assert kls[0] == 0.0 and 0 < kls[1] < kls[2]  # drifting away from the start
    losses = [m["loss"] for _, m in straight.history]
    assert losses[2] != losses[0]
    assert 0 < straight.cost["fraction"] < 1 and straight.cost["seconds"] > 0
    logged = (tmp_path / "run" / "version_0" / "metrics.csv").read_text()
    assert "forgetting/kl" in logged and "forgetting/fraction" in logged
    # Resumed at step 3 from a checkpoint, the KL still counts from the first start.
    first = ForgettingMonitor(reference(), every_n_steps=3, top_k=VOCAB)
    fit(tmp_path / "a", 1, first)
    ckpt = str(next((tmp_path / "a").rglob("epoch=0-step=3.ckpt")))
    resumed = ForgettingMonitor(reference(), every_n_steps=3, top_k=VOCAB)
    _, resumed_module = fit(tmp_path / "b", 2, resumed, ckpt=ckpt)
    for a, b in zip(module.parameters(), resumed_module.parameters()):
        assert torch.equal(a, b)
    assert [s for s, _ in resumed.history] == [0, 3, 6]
    assert resumed.history[-1][1]["kl"] == pytest.approx(kls[2], rel=1e-5)
    assert resumed.history[-1][1]["loss"] == pytest.approx(losses[2], rel=1e-5)


def test_the_hugging_face_callback_reports_through_the_trainer(tmp_path):
    from hf_helpers import lm_data, tiny_causal_lm, training_args

    from lightning_slsam.hf import ForgettingCallback, SAMTrainer

    trainer = SAMTrainer(model=tiny_causal_lm(0), args=training_args(tmp_path, max_steps=4),
                         train_dataset=lm_data(), sam="slsam")  # fmt: skip
    ref = [torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(3))]
    monitor = ForgettingCallback(trainer, ref, every_n_steps=2, top_k=64)
    trainer.add_callback(monitor)
    trainer.train()
    assert [s for s, _ in monitor.history] == [0, 2, 4]
    logged = [e for e in trainer.state.log_history if "forgetting/kl" in e]
    assert logged[0]["forgetting/kl"] == 0.0 and logged[-1]["forgetting/kl"] > 0
    assert any("forgetting/fraction" in e for e in trainer.state.log_history)
