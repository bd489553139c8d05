"""The update a compiled step holds (``funshard.optim.traced``) gives the numbers of the
fs.optim chain it stands for: ``adam``, ``adamw`` (with a decay mask) and ``sgd`` with
momentum (Nesterov, dampening), under a global-norm clip, with leaves that get no gradient
at some steps (their counts, hence their bias corrections, fall behind) and a frozen leaf.
Run here op by op, Adam's numbers are the chain's bit for bit (the compiler fuses the same
ops; the compiled step's tests compare it with the eager step); SGD's last add rounds once
more (a multiply, then an add, where the chain's ``add_(alpha=)`` fuses them)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import funshard as fs
from funshard.optim import traced
from funshard.optim.base import flatten
from funshard.optim.with_policy import with_policy

SHAPES = {"a.weight": (4, 3), "a.bias": (4,), "b.weight": (3, 4), "frozen": (2,)}


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    out["frozen"].requires_grad_(False)
    for k in SHAPES:
        if k != "frozen":
            out[k].requires_grad_(True)
    return out


def _grads(seed, steps, skip):
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for n in range(steps):
        out.append({k: None if k == "frozen" or (k == "a.bias" and n in skip)
                    else torch.randn(s, generator=g) * 3 for k, s in SHAPES.items()})
    return out


def _norm(grads, params):
    """The global norm as the chain's clip measures it (the step hands its own over)."""
    return fs.optim.global_norm(grads, params)


def _run(opt, params, grads_seq, held):
    state = opt.init(params)
    for step, grads in enumerate(grads_seq):
        if not held:
            params, state = opt.update(grads, state, params, step=step)
            continue
        leaves = flatten(grads)[1]
        prep = traced.prepare(opt.traced, leaves, state, params, step=step,
                              norm=_norm(grads, params))
        with torch.no_grad():
            held_leaves = traced.leaves_of(prep, opt.traced, leaves, prep.state, params)
            traced.UPDATES[opt.traced.kind](opt.traced.hyper, prep.static, held_leaves,
                                            torch.tensor(prep.scal[0], dtype=torch.float32))
        state = prep.state
    return params, state


OPTIMIZERS = {
    "adamw": lambda lr: fs.optim.adamw(lr, weight_decay=0.1,
                                       mask=lambda fqn: fqn.endswith("weight")),
    "adamw_fused": lambda lr: fs.optim.adamw(lr, weight_decay=0.05, fused=True),
    "adam": lambda lr: fs.optim.adam(lr, weight_decay=0.01),
    "adam_eps": lambda lr: fs.optim.adam(lr, betas=(0.8, 0.9), eps=0.5),  # eps tells
    "sgd": lambda lr: fs.optim.sgd(lr, momentum=0.9, weight_decay=0.01, dampening=0.1),
    "nesterov": lambda lr: fs.optim.sgd(fs.optim.cosine(lr, 0.0, 10), momentum=0.8,
                                        nesterov=True),
    "sgd_plain": lambda lr: fs.optim.sgd(fs.optim.linear(lr, lr / 4, 6), weight_decay=0.01),
}


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), clip=st.sampled_from([None, 0.5, 1e3]),
       lr=st.sampled_from([1e-3, 0.1]), steps=st.integers(1, 5),
       skip=st.sets(st.integers(0, 4), max_size=2), seed=st.integers(0, 99))
def test_the_held_update_gives_the_chains_numbers(name, clip, lr, steps, skip, seed):
    opt = OPTIMIZERS[name](lr)
    if clip is not None:
        opt = with_policy(opt, clip_norm=clip)
    assert traced.traceable(opt.traced), name
    grads = _grads(seed, steps, skip)
    ep, es = _run(opt, _params(seed), grads, held=False)
    hp, hs = _run(opt, _params(seed), grads, held=True)
    exact = name.startswith("adam") and name != "adamw_fused"  # op for op the chain's
    for k in SHAPES:
        same = torch.equal(hp[k], ep[k]) if exact else torch.allclose(hp[k], ep[k], rtol=1e-5,
                                                                      atol=1e-6)
        assert same, (k, (hp[k] - ep[k]).abs().max())
    for a, b in zip(flatten(hs)[1], flatten(es)[1]):
        if isinstance(a, torch.Tensor):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
        else:
            assert a == b  # the counts, leaf by leaf
    assert torch.equal(hp["frozen"], _params(seed)["frozen"])


def test_only_the_usual_optimizers_have_a_held_form():
    assert traced.traceable(fs.optim.sgd(0.1).traced)  # no momentum: no state either
    assert fs.optim.chain(fs.optim.scale_by_adam(), fs.optim.scale(-1e-3)).traced is None
    # torch's RMSprop, and Adam with amsgrad, step in host code; torch's Adam gated ("torch")
    assert fs.optim.from_torch(torch.optim.RMSprop, lr=1e-3).traced is None
    assert fs.optim.from_torch(torch.optim.Adam, lr=1e-3, amsgrad=True).traced is None
    assert fs.optim.from_torch(torch.optim.Adam, lr=1e-3, foreach=False).traced is None
    assert fs.optim.from_torch(torch.optim.Adam, lr=1e-3).traced.kind == "torch"
    # with select=True, any but NAdam and ASGD (scalars of their own on the host: refused)
    for cls, kw in [(torch.optim.Adam, {"amsgrad": True}), (torch.optim.RMSprop, {}),
                    (torch.optim.SGD, {}), (torch.optim.SGD, {"momentum": 0.9, "fused": True}),
                    (torch.optim.Adagrad, {}), (torch.optim.Rprop, {})]:
        assert fs.optim.from_torch(cls, lr=1e-3, select=True, **kw).traced.kind == "torch"
    for cls, key in [(torch.optim.NAdam, "mu_product"), (torch.optim.ASGD, "eta")]:
        with pytest.raises(ValueError, match=f"select=True cannot select torch.optim."
                                             f"{cls.__name__}'s step.*{key}"):
            fs.optim.from_torch(cls, lr=1e-3, select=True)
    twice = with_policy(with_policy(fs.optim.adamw(1e-3), clip_norm=1.0), clip_norm=2.0)
    assert twice.traced is None  # two clips in front: the chain's own update
    once = with_policy(fs.optim.adamw(1e-3), clip_norm=1.0, skip_nonfinite=True)
    assert once.traced.clip == 1.0


def test_a_leaf_that_has_no_state_is_refused_by_name():
    opt = fs.optim.adamw(1e-3)
    params = _params(0)
    state = opt.init(params)
    leaves = [torch.ones(s) for s in SHAPES.values()]  # a gradient for the frozen leaf too
    order = flatten(params)[0]
    try:
        traced.prepare(opt.traced, leaves, state, params, step=0, norm=1.0)
    except ValueError as e:
        assert "frozen" in str(e) and "no optimizer state" in str(e), e
    else:
        raise AssertionError(f"not refused: {order}")


def test_a_mask_that_is_not_a_bool_is_refused_as_the_chain_refuses_it():
    opt = fs.optim.adamw(1e-3, weight_decay=0.1, mask=lambda fqn: 1)
    params = _params(0)
    state = opt.init(params)
    leaves = flatten(_grads(0, 1, set())[0])[1]
    errors = []
    for run in (lambda: opt.update(_grads(0, 1, set())[0], state, params, step=0),
                lambda: traced.prepare(opt.traced, leaves, state, params, step=0, norm=1.0)):
        try:
            run()
        except TypeError as e:
            errors.append(str(e))
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert "a.bias" in errors[1] or "a.weight" in errors[1], errors


def test_the_update_program_takes_gradients_in_another_memory_layout():
    """The compiled update reads nothing of the caller's: gradients that come with other
    strides (an eager step's bucket views, then a program's tensors) are compiled for
    again, not refused, and the numbers stay the chain's."""
    from funshard.step.update_program import UpdateProgram

    torch._dynamo.reset()
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    program = UpdateProgram({"backend": "aot_eager"})
    params, ref = _params(1), _params(1)
    state, ref_state = opt.init(params), opt.init(ref)
    for step, grads in enumerate(_grads(1, 3, set())):
        if step == 1:  # the same values, column-major where a leaf is a matrix
            grads = {k: None if g is None else
                     (g.t().contiguous().t() if g.ndim == 2 else g) for k, g in grads.items()}
        norm = _norm(grads, params)
        params, state = program(opt, grads, state, params, step=step, norm=norm,
                                device=torch.device("cpu"))
        ref, ref_state = opt.update(grads, ref_state, ref, step=step)
    torch._dynamo.reset()
    for k in SHAPES:
        assert torch.allclose(params[k], ref[k], rtol=1e-6, atol=1e-7), k


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), steps=st.integers(1, 5),
       skip=st.sets(st.integers(0, 4), max_size=2), seed=st.integers(0, 99))
def test_a_step_in_doubt_gives_both_cases_scalars(name, steps, skip, seed):
    """With the step before in doubt (counted, its verdict unread), the scalars' second
    case is what the state would give had that step been skipped: its leaves' counts one
    fewer and the step one back (the schedule's); the first case, the state's own."""
    opt = OPTIMIZERS[name](0.1)
    params, grads = _params(seed), _grads(seed, steps + 1, skip)
    state = opt.init(params)
    for step, g in enumerate(grads[:-1]):  # counted as the compiled step counts them
        state = traced.prepare(opt.traced, flatten(g)[1], state, params, step=step,
                               norm=None).state
    doubt = tuple(i for i, x in enumerate(flatten(grads[-2])[1]) if x is not None)
    now, n = flatten(grads[-1])[1], steps
    if not traced.decided(opt.traced, state, doubt, n):
        assert opt.traced.kind == "sgd"  # a leaf's first update in doubt: read instead
        return
    both = traced.prepare(opt.traced, now, state, params, step=n, norm=None, doubt=doubt)
    plain = traced.prepare(opt.traced, now, state, params, step=n, norm=None)
    skipped = traced.prepare(opt.traced, now,
                             state._replace(count=traced.uncount(state.count, doubt)),
                             params, step=n - 1, norm=None)
    for case, alone in ((0, plain), (1, skipped)):
        rows = {i: row for group, row in zip(both.groups, both.scal[case]) for i in group}
        want = {i: row for group, row in zip(alone.groups, alone.scal[0]) for i in group}
        assert rows == want, (case, rows, want)
    assert both.state == plain.state  # the counts advance as if the step before applied


def _piece(kind, fused, lr):
    O = fs.optim
    return {"adam": lambda: O.scale_by_adam(0.8, 0.95, 1e-6, fused=fused),
            "trace": lambda: O.trace(0.9, nesterov=True),
            "decay": lambda: O.add_decayed_weights(0.05, lambda fqn: fqn.endswith("weight")),
            "lr": lambda: O.scale_by_learning_rate(O.cosine(lr, 0.0, 5)),
            "scale": lambda: O.scale(-lr)}[kind]()


CORES = {  # the members' order -> the optimizer it is (None: none of them)
    ("adam", "decay", "lr"): "adamw", ("adam", "lr"): "adamw", ("decay", "adam", "lr"): "adam",
    ("trace", "lr"): "sgd", ("decay", "trace", "lr"): "sgd",
    ("adam", "lr", "decay"): None, ("decay", "lr"): None, ("adam", "scale"): None,
    ("adam", "decay", "decay", "lr"): None, ("trace", "decay", "lr"): None}


@settings(max_examples=30, deadline=None)
@given(core=st.sampled_from(sorted(CORES)), front=st.sampled_from(
           [(), ("clip",), ("finite", "clip"), ("clip", "finite"), ("clip", "clip")]),
       nested=st.booleans(), fused=st.booleans(), lr=st.sampled_from([1e-3, 0.1]),
       steps=st.integers(1, 4), skip=st.sets(st.integers(0, 3), max_size=1),
       seed=st.integers(0, 99))
def test_a_chain_of_fs_optims_pieces_is_recognised_by_what_it_does(core, front, nested, fused,
                                                                   lr, steps, skip, seed):
    """A law over chains of fs.optim's own transformations (a clip and apply_if_finite in
    front or not, the rest nested in a chain of its own or not): where the members are one
    of ``adam``, ``adamw``, ``sgd`` in their chain's order, with one clip at most, the chain
    has their traced form, and the update it stands for gives the chain's own numbers; any
    other order (the decay after the learning rate, two decays, a plain scale) has none."""
    O = fs.optim
    heads = [O.clip_by_global_norm(0.5 if front[:k].count("clip") == 0 else 2.0) if f == "clip"
             else O.apply_if_finite() for k, f in enumerate(front)]
    body = [_piece(k, fused, lr) for k in core]
    opt = O.chain(*heads, O.chain(*body)) if nested else O.chain(*heads, *body)
    want = CORES[core]
    if want == "adam" and fused:
        want = None  # the fused kernel has no L2 penalty: that chain stays its own
    if front.count("clip") > 1 or want is None:
        assert opt.traced is None, (core, front)
        return
    t = opt.traced
    assert t is not None and t.kind == ("sgd" if want == "sgd" else "adam"), t
    assert t.decoupled == (want == "adamw") and t.clip == (0.5 if "clip" in front else None)
    grads = _grads(seed, steps, skip)
    ep, _ = _run(opt, _params(seed), grads, held=False)
    hp, _ = _run(opt, _params(seed), grads, held=True)
    for k in SHAPES:
        exact = want != "sgd" and not fused
        same = torch.equal(hp[k], ep[k]) if exact else torch.allclose(hp[k], ep[k], rtol=1e-5,
                                                                      atol=1e-6)
        assert same, (k, (hp[k] - ep[k]).abs().max())


def test_the_named_optimizers_are_their_chains_recognised():
    """adam, adamw and sgd are plain chains: what they do is read off their members."""
    mask = lambda fqn: True
    T = traced.Traced
    assert fs.optim.adamw(1e-3, (0.8, 0.9), 1e-6, 0.1, mask=mask, fused=True).traced == T(
        "adam", 1e-3, (0.8, 0.9, 1e-6), 0.1, True, mask, fused=True)
    assert fs.optim.adam(1e-3, weight_decay=0.1).traced == T("adam", 1e-3, (0.9, 0.999, 1e-8),
                                                            0.1, False, None)
    assert fs.optim.sgd(0.1, 0.9, 0.01, dampening=0.5).traced == T("sgd", 0.1, (0.9, 0.5, False),
                                                                   0.01, False, None)
