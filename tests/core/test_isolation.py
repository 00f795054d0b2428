"""What one pass may leave behind (:mod:`lightning_slsam.core.isolation`): which pass's
BatchNorm statistics count, extra forwards that never do, and dropout replay between the
passes."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import LitModel, loader, make_data, trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_slsam import ESAM, SAM, SSAMF, make_engine
from lightning_slsam.core.isolation import (
    BN_STATS,
    PassIsolation,
    RunningStats,
    random_state,
    restore_random_state,
)


class BNRecorder(L.Callback):
    """The model before the step, and its weights during the second pass."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = copy.deepcopy(pl_module.model)


def _bn_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if "running" in n or "tracked" in n}


@pytest.mark.parametrize("bn_stats", ["first", "second", "both"])
def test_batchnorm_statistics_on_efficientnet_lite0(bn_stats):
    from examples.tasks.vision import DigitsDataModule, ImageClassifier

    class Recording(ImageClassifier):
        def training_step(self, batch, batch_idx):
            if self.sam_pass == 2:
                self.perturbed = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    data = DigitsDataModule(batch_size=8, image_size=32, num_train=8)
    data.setup("fit")
    model = Recording()
    recorder = BNRecorder()
    trainer(callbacks=[SAM(rho=0.05, bn_stats=bn_stats), recorder], max_steps=1).fit(
        model, DataLoader(data.train_set, batch_size=8)
    )
    images = data.train_set.tensors[0]
    first = copy.deepcopy(recorder.start).train()
    with torch.no_grad():
        first(images)  # the statistics pass 1 alone would leave
    second = copy.deepcopy(recorder.start).train()
    with torch.no_grad():
        for name, p in second.named_parameters():
            p.copy_(model.perturbed[name])
        second(images)  # ... and pass 2 alone
    both = copy.deepcopy(first)
    with torch.no_grad():
        for name, p in both.named_parameters():
            p.copy_(model.perturbed[name])
        both(images)
    expected = {"first": first, "second": second, "both": both}[bn_stats]
    ours = _bn_buffers(model.model)
    for name, value in _bn_buffers(expected).items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)
    tracked = ours["bn1.num_batches_tracked"].item()
    assert tracked == (2 if bn_stats == "both" else 1)


@pytest.mark.parametrize("method", [ESAM(seed=0), SSAMF(fisher_samples=4)])
def test_extra_forwards_never_count_for_batchnorm(method):
    class BNNet(LitModel):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y, reduction="none")

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    model = BNNet(net)
    x = make_data(16).tensors[0]
    reference = copy.deepcopy(net).train()
    with torch.no_grad():
        reference(x)
    trainer(callbacks=[method], max_steps=1).fit(model, loader(make_data(16), 16))
    assert model.net[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(model.net[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model.net[1].running_var, reference[1].running_var)


@pytest.mark.parametrize("replay", [True, False])
def test_dropout_replay_gives_the_second_pass_the_first_pass_masks(replay):
    masks = []
    net = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 3))
    net[1].register_forward_hook(lambda m, i, out: masks.append(out.detach() == 0))
    trainer(callbacks=[SAM(replay_dropout=replay)], max_steps=3).fit(
        LitModel(net), loader(make_data(48), 16)
    )
    assert len(masks) == 6
    same = [torch.equal(masks[2 * i], masks[2 * i + 1]) for i in range(3)]
    assert same == [replay] * 3
    assert not torch.equal(masks[0], masks[2])  # steps still draw new masks


# -- the parts, directly -----------------------------------------------------------------------


def test_running_stats_snapshot_restore_and_evaluate_without_changing_them():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.LayerNorm(6))
    stats = RunningStats(net)
    assert len(stats.layers) == 1 and len(stats.buffers) == 3  # mean, var, batches tracked
    saved = stats.snapshot()
    net(torch.randn(8, 4))
    assert int(net[1].num_batches_tracked) == 1 and not torch.equal(stats.buffers[0], saved[0])
    stats.restore(saved)
    assert all(torch.equal(b, s) for b, s in zip(stats.buffers, saved))
    with stats.evaluating():
        assert not net[1].training
        net(torch.randn(1, 4))  # one sample: the running statistics normalise it
    assert net[1].training and all(torch.equal(b, s) for b, s in zip(stats.buffers, saved))
    assert not RunningStats(nn.Linear(2, 2))  # nothing to manage
    assert BN_STATS == ("first", "second", "both")


def test_random_state_rewinds_the_stream_and_the_engine_isolates_only_what_it_must():
    state = random_state()
    first = torch.rand(3)
    restore_random_state(state)
    assert torch.equal(torch.rand(3), first)
    # Nothing to isolate without running statistics or dropout replay.
    assert make_engine("sam", nn.Linear(4, 2)).isolation is None
    bn = make_engine("sam", nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))).isolation
    assert isinstance(bn, PassIsolation) and bn.bn_stats == "first" and not bn.replay_dropout
    replay = make_engine("sam", nn.Linear(4, 2), replay_dropout=True).isolation
    assert replay is not None and replay.stats is None and replay.replay_dropout
