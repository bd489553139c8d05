"""torch's own modules, as users bring them: recurrent layers (their flat weight lists),
attention (``in_proj_weight`` through ``F.multi_head_attention_forward``, the fast path in
evaluation), a transformer encoder, a weight-norm parametrization, convolutions with group
norm, bilinear and PReLU. Each trains on 1, 2 and 2x2 ranks as one process on the whole
batch (float32, SHARD_GRAD_OP, bfloat16 compute), and ``eval_step`` gives the module's own
output; an embedding that renormalizes its rows in place (``max_norm``) is refused by name.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funshard as fs
from funshard.testing import capture, mesh

B, T, D = 2, 5, 6  # rows per rank, sequence, features


class Recurrent(nn.Module):
    """A recurrent layer (its flat weight lists) and a head on its last step's output."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.att(h, h, h, need_weights=False)[0][:, -1])


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(self.inp(x))[:, -1])


class WeightNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(D, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)).mean(1))


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(D, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.c2 = nn.Conv2d(1, 2, (3, 3), padding=1)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.norm(self.c1(x.transpose(1, 2)))  # (B, 8, T)
        h = self.c2(h.unsqueeze(1)).mean(-1)  # (B, 2, 8)
        return self.head(h.flatten(1))


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.PReLU(T)
        self.bil = nn.Bilinear(D, D, 3)

    def forward(self, x):
        h = self.act(x).mean(1)
        return self.bil(h, h)


MODELS = {"lstm": lambda: Recurrent(nn.LSTM(D, 8, num_layers=2, batch_first=True)),
          "gru": lambda: Recurrent(nn.GRU(D, 8, batch_first=True, bidirectional=True)),
          "attention": Attention, "encoder": Encoder,
          "weight_norm": WeightNorm, "conv": Conv, "bilinear": Bilinear}
# every top-level child its own group: several groups per model
BY_CHILD = {"groups": lambda fqn: fqn.split(".")[0]}
POLICIES = {"fp32": {}, "grad_op": {"reshard_after_forward": False},
            "bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}}


def _model(kind):
    torch.manual_seed(0)
    return MODELS[kind]()


def _batch(step, world):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(world * B, T, D, generator=g), torch.randn(world * B, 3, generator=g)


def _reference(kind, world, dtype, steps):
    """One process: each rank's rows through the module (its parameters and input cast to
    ``dtype``, as the step casts them), each rank's gradient in float32, their mean; SGD."""
    model = _model(kind)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    for s in range(steps):
        x, y = _batch(s, world)
        grads = {k: torch.zeros_like(v) for k, v in params.items()}
        for r in range(world):
            full = {k: v.to(dtype).requires_grad_() for k, v in params.items()}
            xr = x[r * B:(r + 1) * B].to(dtype)
            loss = F.mse_loss(torch.func.functional_call(model, full, (xr,)).float(),
                              y[r * B:(r + 1) * B])
            for k, g in zip(full, torch.autograd.grad(loss, list(full.values()))):
                grads[k] += g.float()
        params = {k: v - 0.1 * grads[k] / world for k, v in params.items()}
    return params


def train_every_module(spec, steps=2):
    """Per model and policy: the largest parameter difference to one process; per model:
    eval_step's output against the trained module's own (float32, evaluation mode)."""
    m = mesh(spec)
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for kind in MODELS:
        for name, pol in POLICIES.items():
            model = _model(kind)
            policy = fs.Policy(**pol, **BY_CHILD)

            def loss_fn(p, b, model=model):
                return F.mse_loss(fs.call(model, p, b[0]).float(), b[1])

            step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1), policy=policy)
            state = step.init(fs.shard(fs.params(model), m))
            for s in range(steps):
                x, y = _batch(s, world)
                state, _ = step(state, (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]))
            ref = _reference(kind, world, pol.get("param_dtype", torch.float32), steps)
            full = fs.unshard(state.params)
            out[kind, name] = max((full[k] - v).abs().max().item() for k, v in ref.items())
            if name == "fp32":
                trained = copy.deepcopy(model).eval()
                trained.load_state_dict(full)
                model.eval()
                ev = fs.eval_step(lambda p, x, model=model: fs.call(model, p, x), policy=policy)
                x = _batch(9, 1)[0]
                with torch.no_grad():
                    out[kind, "eval"] = (ev(state.params, x) - trained(x)).abs().max().item()
    return out


@pytest.mark.parametrize("spec", [1, 2, "2x2"])
def test_torch_modules_train_as_one_process(pools, spec):
    for r in pools.run(spec, train_every_module):
        assert set(r) == {(k, p) for k in MODELS for p in (*POLICIES, "eval")}, sorted(r)
        bad = {key: err for key, err in r.items() if not err < 1e-6}
        assert not bad, bad


class RenormEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, D, max_norm=1.0)
        self.head = nn.Linear(D, 3)

    def forward(self, tokens):
        return self.head(self.e(tokens).mean(1))


def renorm_embedding(spec):
    m = mesh(spec)
    torch.manual_seed(0)
    model = RenormEmbedding()
    step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                         fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(fs.params(model), m))
    batch = (torch.randint(0, 10, (B, T)), torch.randn(B, 3))
    return capture(lambda: step(state, batch))


@pytest.mark.parametrize("spec", [1, 2])
def test_embedding_max_norm_is_refused_by_name(pools, spec):
    """``nn.Embedding(max_norm=)`` renormalizes the rows it reads in place, under no_grad:
    inside the step that write would go to a gathered copy and be lost (and the ranks would
    renormalize different rows), so the step refuses it, naming the weight."""
    for kind, msg in pools.run(spec, renorm_embedding):
        assert kind == "RuntimeError" and "'e.weight' in place" in msg, (kind, msg)
