"""Precision as one object: fp32, bf16 (no scaler, refuses one) and fp16 (GradScaler in Horovod's
order) all train on CPU; fp16 skips an overflowing step and its scaler state round-trips."""

import pytest
import torch

from common.dataset import LabelSpec
from plugin_models import Wrap
from training.distributed import LocalGroup
from training.tasks import Objective
from training.strategies.single import SingleProcess
from training.precision import Precision

CLASSES_2 = LabelSpec(name="label", task="classification", num_classes=2)


def train_step(model, micro_batches, optimizer, precision, clip_norm, distill=None):
    """One optimizer step of the one-process strategy, as the rank loop takes it."""
    strategy = SingleProcess(LocalGroup(), precision)
    return strategy.train_step(model, micro_batches, optimizer, Objective(CLASSES_2, distill), clip_norm)



def _model_and_batch(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    return model, x, y


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp16"])
def test_every_precision_trains_on_cpu(kind):
    net, x, y = _model_and_batch()
    model = Wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    precision = Precision(kind, "cpu")
    batch = {"numeric": x, "label": y}
    first = float(train_step(model, [batch], opt, precision, 1.0))
    for _ in range(30):
        last = float(train_step(model, [batch], opt, precision, 1.0))
    assert last < first * 0.7
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay fp32
    assert (precision.scaler is not None) == (kind == "fp16")


def test_bf16_refuses_a_scaler():
    with pytest.raises(ValueError, match="no GradScaler"):
        Precision("bf16", "cpu", scaler=torch.amp.GradScaler("cpu"))


def test_fp16_skips_an_overflowing_step_and_checkpoints_its_scale():
    net, x, _ = _model_and_batch()
    model = Wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16", "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    scale = precision.scaler.get_scale()
    with precision.autocast():
        loss = model({"numeric": x}).float().sum() * float("inf")
    precision.backward(loss)
    precision.unscale_(opt)
    precision.step(opt)
    precision.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # step skipped
    assert precision.scaler.get_scale() < scale  # and the scale backed off
    restored = Precision("fp16", "cpu")
    restored.load_state_dict(precision.state_dict())
    assert restored.scaler.get_scale() == precision.scaler.get_scale()


def test_grad_accumulation_equals_one_big_batch():
    """2 micro-batches of b == 1 batch of 2b (fp32, same init); tolerance 1e-6 absolute (float32 sum order)."""
    net_a, x, y = _model_and_batch(seed=1)
    net_b, _, _ = _model_and_batch(seed=1)
    a, b = Wrap(net_a), Wrap(net_b)
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=0.01), torch.optim.AdamW(b.parameters(), lr=0.01)
    fp32 = Precision("fp32", "cpu")
    for _ in range(3):
        halves = [{"numeric": x[:32], "label": y[:32]}, {"numeric": x[32:], "label": y[32:]}]
        la = train_step(a, halves, opt_a, fp32, None)
        lb = train_step(b, [{"numeric": x, "label": y}], opt_b, fp32, None)
        assert abs(float(la) - float(lb)) < 1e-6
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)
