"""Tests for matrixfsdp.optim.functional: float64 references, torch.optim.Muon parity,
Scaled CANS accuracy, batching, packing and config validation.

The float64 references (tests/references.py) are written from the published formulas and
the reference implementations' conventions, independently of the library code.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from matrixfsdp.optim.functional import (
    FUNCTIONAL_OPTIMIZERS,
    EmaGramConfig,
    MuonConfig,
    OKLSConfig,
    ShampooConfig,
    SOAPConfig,
    inverse_sqrt_cans,
    lambda_max_upper_bound,
    pack_sym,
    packed_dim,
    sqrt_residual,
    unpack_sym,
)

from .references import check_eigenbasis, make_reference

F64 = torch.float64
SHAPES = [(24, 40), (40, 24)]
STEPS = 10
LR, WD = 0.02, 0.1


# --------------------------------------------------------------------------- helpers


def _problem(shape: tuple[int, ...], seed: int, steps: int = STEPS):
    """Initial weights and a gradient sequence with some temporal correlation."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(*shape, generator=gen)
    base = torch.randn(*shape, generator=gen)
    grads = [base + 0.7 * torch.randn(*shape, generator=gen) for _ in range(steps)]
    return w0, grads


def _run_lib(name, config, w0, grads, *, lr=LR, wd=WD, lrs=None):
    """Run the library's step function; returns (final param, state)."""
    _, init_fn, step_fn = FUNCTIONAL_OPTIMIZERS[name]
    param = w0.clone()
    state = init_fn(param, config)
    for t, g in enumerate(grads, start=1):
        lr_t = lr if lrs is None else lrs[t - 1]
        step_fn(
            param, g.clone(), state, lr=lr_t, weight_decay=wd, step=t, initial_lr=lr, config=config
        )
    return param, state


def _rel_update_error(w0, w_lib, w_ref) -> float:
    """||dW_lib - dW_ref|| / ||dW_ref|| with dW the total change over the run."""
    d_lib = w_lib.double() - w0.double()
    d_ref = w_ref - w0.double()
    return (torch.linalg.norm(d_lib - d_ref) / torch.linalg.norm(d_ref)).item()


def _run_ref(name, w0, grads, *, lr=LR, wd=WD, lrs=None, **hyper):
    """Run the float64 reference of tests/references.py; returns the final weights."""
    ref = make_reference(name, tuple(w0.shape), **hyper)
    W = w0.double()
    for t, g in enumerate(grads, start=1):
        lr_t = lr if lrs is None else lrs[t - 1]
        W = ref.step(W, g, lr=lr_t, weight_decay=wd, initial_lr=lr)
    return W


def _ref_muon(w0, grads, *, nesterov=True):
    return _run_ref("muon", w0, grads, nesterov=nesterov)


def _ref_okls(w0, grads, *, lrs=None):
    return _run_ref("okls", w0, grads, lrs=lrs)


# --------------------------------------------------------------------------- 1. float64 references


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_float64_reference(shape, nesterov):
    w0, grads = _problem(shape, seed=1)
    cfg = MuonConfig(nesterov=nesterov, ns_dtype="float32")
    w_lib, _ = _run_lib("muon", cfg, w0, grads)
    err = _rel_update_error(w0, w_lib, _ref_muon(w0, grads, nesterov=nesterov))
    assert err <= 1e-5, err  # fp32 Newton-Schulz: measured 7e-6..9e-6 over 80 seeds/cases


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("root_dtype", ["float32", "float64"])
def test_shampoo_matches_float64_reference(shape, root_dtype):
    w0, grads = _problem(shape, seed=2)
    # Default relative eps = 1e-6: the factors are rank-deficient over 10 steps,
    # but the momentum lies in their range, so the noisy null-space roots of an
    # fp32 eigh do not reach the update (measured error ~2e-6).
    cfg = ShampooConfig(betas=(0.9, 0.95), root_dtype=root_dtype)
    w_lib, _ = _run_lib("shampoo", cfg, w0, grads)
    w_ref = _run_ref("shampoo", w0, grads, betas=(0.9, 0.95))
    err = _rel_update_error(w0, w_lib, w_ref)
    assert err <= 1e-4, err


# Distributed Shampoo's conventions: bias correction, absolute epsilon, start/refresh schedule.
SHAMPOO_CONVENTIONS = [
    dict(grafting="none", eps_mode="absolute", eps=1e-3, precondition_frequency=3),
    dict(grafting="adam", eps_mode="absolute", eps=1e-3, precondition_frequency=2,
         start_preconditioning_step=4, bias_correction=False),
    dict(grafting="none", eps_mode="relative", bias_correction=False),
    dict(grafting="adam", eps=1e-4, precondition_frequency=3, start_preconditioning_step=1),
    dict(grafting="none", betas=(0.9, 1.0), eps_mode="absolute", eps=1e-2,
         precondition_frequency=2),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hyper", SHAMPOO_CONVENTIONS, ids=lambda h: "-".join(map(str, h.values())))
def test_shampoo_conventions_match_float64_reference(shape, hyper):
    w0, grads = _problem(shape, seed=13)
    hyper = {"betas": (0.9, 0.95), **hyper}
    w_lib, _ = _run_lib("shampoo", ShampooConfig(root_dtype="float64", **hyper), w0, grads)
    err = _rel_update_error(w0, w_lib, _run_ref("shampoo", w0, grads, **hyper))
    assert err <= 2e-5, err  # fp32 state against float64: measured 2.6e-6..9.7e-6


def test_shampoo_bias_correction_scales_the_ungrafted_step():
    """Without bias correction the first step is larger by (1 - b1) / sqrt(1 - b2)."""
    w0, grads = _problem((8, 12), seed=14, steps=1)
    steps = {}
    for bias_correction in (True, False):
        cfg = ShampooConfig(grafting="none", bias_correction=bias_correction)
        w, _ = _run_lib("shampoo", cfg, w0, grads, wd=0.0)
        steps[bias_correction] = (w - w0).double()
    ratio = torch.linalg.norm(steps[False]) / torch.linalg.norm(steps[True])
    assert ratio.item() == pytest.approx(0.1 / math.sqrt(0.001), rel=1e-5)  # 3.16 at (0.9, 0.999)


@pytest.mark.parametrize(
    ("frequency", "start", "refresh_steps"),
    [(1, -1, range(1, 10)), (3, -1, [3, 6, 9]), (3, 5, [5, 6, 9]), (4, 1, [1, 4, 8])],
)
def test_shampoo_refresh_schedule(frequency, start, refresh_steps):
    """Roots change exactly on Distributed Shampoo's grid; before the start the step is the
    grafting direction (Adam), or the bias-corrected momentum without grafting."""
    w0, grads = _problem((6, 9), seed=15, steps=9)
    for grafting in ("adam", "none"):
        cfg = ShampooConfig(grafting=grafting, precondition_frequency=frequency,
                            start_preconditioning_step=start)
        _, init_fn, step_fn = FUNCTIONAL_OPTIMIZERS["shampoo"]
        param = w0.clone()
        state = init_fn(param, cfg)
        changed, first = [], cfg.first_preconditioned_step
        for t, g in enumerate(grads, start=1):
            roots = state["L_root"].clone()
            before = param.clone()
            step_fn(param, g, state, lr=LR, weight_decay=0.0, step=t, initial_lr=LR, config=cfg)
            if not torch.equal(roots, state["L_root"]):
                changed.append(t)
            if t < first:
                m_hat = state["exp_avg"] / (1 - 0.9**t)
                if grafting == "adam":
                    m_hat = m_hat / ((state["exp_avg_sq"] / (1 - 0.999**t)).sqrt() + 1e-8)
                torch.testing.assert_close(before - param, LR * m_hat, rtol=1e-5, atol=5e-7)
        assert changed == list(refresh_steps), (grafting, changed)


@pytest.mark.parametrize("shape", SHAPES)
def test_emagram_absolute_eps_matches_float64_reference(shape):
    w0, grads = _problem(shape, seed=16)
    hyper = {"betas": (0.9, 0.95), "eps_mode": "absolute", "eps": 1e-1, "precondition_frequency": 2}
    w_lib, _ = _run_lib("emagram", EmaGramConfig(**hyper), w0, grads)
    err = _rel_update_error(w0, w_lib, _run_ref("emagram", w0, grads, **hyper))
    assert err <= 2e-5, err  # measured 8.5e-6 (24x40), 8.1e-6 (40x24)


@pytest.mark.parametrize("shape", SHAPES)
def test_soap_matches_float64_reference(shape):
    w0, grads = _problem(shape, seed=3)
    cfg = SOAPConfig(betas=(0.95, 0.95), eps=1e-8, precondition_frequency=3)
    # The eigenbasis of a rank-deficient first factor (G G^T or G^T G of a
    # non-square G) is arbitrary inside its null space, so the reference starts
    # from the library's step-1 basis after checking it is a valid one.
    _, init_fn, step_fn = FUNCTIONAL_OPTIMIZERS["soap"]
    probe = w0.clone()
    state = init_fn(probe, cfg)
    step_fn(
        probe, grads[0].clone(), state, lr=LR, weight_decay=WD, step=1, initial_lr=LR, config=cfg
    )
    assert torch.equal(probe, w0)  # step 1 only initialises
    G1 = grads[0].double()
    check_eigenbasis(state["Q_L"], G1 @ G1.T)
    check_eigenbasis(state["Q_R"], G1.T @ G1)
    w_lib, _ = _run_lib("soap", cfg, w0, grads)
    basis = (state["Q_L"].double(), state["Q_R"].double())
    w_ref = _run_ref("soap", w0, grads, betas=(0.95, 0.95), eps=1e-8, precondition_frequency=3,
                     pick_basis=lambda *_, index: basis)
    err = _rel_update_error(w0, w_lib, w_ref)
    assert err <= 1e-4, err


@pytest.mark.parametrize("shape", SHAPES)
def test_okls_matches_float64_reference(shape):
    w0, grads = _problem(shape, seed=4)
    lrs = [LR * (1 - 0.05 * i) for i in range(STEPS)]  # decaying lr exercises AdamC
    cfg = OKLSConfig(fp16_scaled=False)
    w_lib, state = _run_lib("okls", cfg, w0, grads, lrs=lrs)
    m, n = shape
    assert state["S_a"].shape == (m * (m + 1) // 2,) and state["P_b"].shape == (n * (n + 1) // 2,)
    w_ref = _ref_okls(w0, grads, lrs=lrs)
    err = _rel_update_error(w0, w_lib, w_ref)
    assert err <= 1e-4, err  # measured 1.3e-5 (24x40) and 1.7e-5 (40x24)
    # the eigh root method is the same algorithm with exact roots
    w_eigh, _ = _run_lib("okls", OKLSConfig(root_method="eigh"), w0, grads, lrs=lrs)
    assert _rel_update_error(w0, w_eigh, w_ref) <= 5e-5  # fp32 state; measured ~7e-6


def test_okls_fp16_scaled_path_tracks_reference():
    w0, grads = _problem((24, 40), seed=5)
    w_lib, _ = _run_lib("okls", OKLSConfig(fp16_scaled=True), w0, grads)
    err = _rel_update_error(w0, w_lib, _ref_okls(w0, grads))
    assert err <= 1e-2, err  # measured 1.4e-3 (24x40), 2.6e-3 (40x24)


@pytest.mark.parametrize("shape", SHAPES)
def test_emagram_matches_float64_reference(shape):
    w0, grads = _problem(shape, seed=6)
    cfg = EmaGramConfig(betas=(0.9, 0.95))
    w_lib, _ = _run_lib("emagram", cfg, w0, grads)
    w_ref = _run_ref("emagram", w0, grads, betas=(0.9, 0.95))
    err = _rel_update_error(w0, w_lib, w_ref)
    assert err <= 1e-4, err


# --------------------------------------------------------------------------- 2. torch.optim.Muon parity


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", SHAPES)
def test_muon_bitwise_matches_torch_muon(nesterov, adjust_lr_fn, shape):
    w0, grads = _problem(shape, seed=7)
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon(
        [ref], lr=LR, weight_decay=WD, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn
    )
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    cfg = MuonConfig(nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    w_lib, state = _run_lib("muon", cfg, w0, grads)
    assert torch.equal(w_lib, ref.detach())
    assert torch.equal(state["momentum_buffer"], opt.state[ref]["momentum_buffer"])


# --------------------------------------------------------------------------- 3. Scaled CANS


def _spd(d: int, cond: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=F64))
    lam = torch.logspace(0.0, -math.log10(cond), d, dtype=F64)
    return ((Q * lam) @ Q.T).float()


@pytest.mark.parametrize("d", [16, 64, 256])
@pytest.mark.parametrize("cond", [1.0, 10.0, 100.0, 1e3])
def test_cans_residual(d, cond):
    S = _spd(d, cond, seed=d)
    W = inverse_sqrt_cans(S, fp16_scaled=False)
    assert W.dtype == torch.float32 and W.shape == S.shape
    assert sqrt_residual(S, W).item() <= 1e-4
    # fp16 GEMM inputs (emulated on CPU): measured <= 2.1e-2 over this grid
    W16 = inverse_sqrt_cans(S, fp16_scaled=True)
    assert sqrt_residual(S, W16).item() <= 3e-2


def test_cans_batched_and_upper_bound():
    specs = [(1.0, 1.0), (50.0, 1e-3), (900.0, 7.0)]  # (condition number, scale)
    S = torch.stack([_spd(32, c, seed=i) * s for i, (c, s) in enumerate(specs)])
    W = inverse_sqrt_cans(S, fp16_scaled=False)
    for i in range(3):
        W_i = inverse_sqrt_cans(S[i], fp16_scaled=False)
        # batched vs single baddbmm may round differently: measured <= 3.2e-6
        assert torch.linalg.norm(W[i] - W_i) <= 1e-5 * torch.linalg.norm(W_i)
    assert bool((sqrt_residual(S, W) <= 1e-4).all())
    lam_max = torch.linalg.eigvalsh(S.double())[..., -1]
    assert bool((lambda_max_upper_bound(S).double() >= lam_max * (1 - 1e-6)).all())


# --------------------------------------------------------------------------- 4. batched == per-slice

_BATCH_CONFIGS = {
    "muon": MuonConfig(),
    "shampoo": ShampooConfig(precondition_frequency=2),
    "soap": SOAPConfig(precondition_frequency=2),
    "okls": OKLSConfig(),
    "emagram": EmaGramConfig(precondition_frequency=2),
}


@pytest.mark.parametrize("name", sorted(_BATCH_CONFIGS))
def test_batched_equals_per_slice(name):
    cfg = _BATCH_CONFIGS[name]
    w0, grads = _problem((3, 16, 24), seed=8, steps=6)
    w_batched, state_b = _run_lib(name, cfg, w0, grads)
    for i in range(3):
        w_i, state_i = _run_lib(name, cfg, w0[i], [g[i] for g in grads])
        assert torch.allclose(w_batched[i], w_i, rtol=1e-6, atol=1e-6), name
        for key, value in state_i.items():
            assert state_b[key][i].shape == value.shape, key


def test_muon_fp32_batched_is_bitwise_per_slice():
    cfg = MuonConfig(ns_dtype="float32")
    w0, grads = _problem((3, 16, 24), seed=9, steps=4)
    w_batched, _ = _run_lib("muon", cfg, w0, grads)
    for i in range(3):
        w_i, _ = _run_lib("muon", cfg, w0[i], [g[i] for g in grads])
        assert torch.equal(w_batched[i], w_i)


def test_state_dtypes_for_bf16_params():
    w0, grads = _problem((16, 24), seed=10, steps=2)
    w0 = w0.bfloat16()
    for name, (cfg_cls, init_fn, _) in FUNCTIONAL_OPTIMIZERS.items():
        state = init_fn(w0, cfg_cls())
        assert "step" not in state
        for key, value in state.items():
            if name != "muon":
                assert value.dtype == torch.float32, (name, key)
        param, _ = _run_lib(name, cfg_cls(), w0, [g.bfloat16() for g in grads])
        assert param.dtype == torch.bfloat16 and bool(torch.isfinite(param).all())


# --------------------------------------------------------------------------- 5. packing, configs


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
def test_pack_unpack_round_trip(lead):
    x = torch.randn(*lead, 7, 7)
    x = x + x.mT
    v = pack_sym(x)
    assert v.shape == (*lead, 28)
    assert torch.equal(unpack_sym(v, 7), x)
    assert torch.equal(unpack_sym(v), x)
    assert packed_dim(28) == 7
    with pytest.raises(ValueError):
        packed_dim(27)


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (MuonConfig, {"momentum": 1.5}, "MuonConfig.momentum"),
        (MuonConfig, {"ns_steps": 0}, "MuonConfig.ns_steps"),
        (MuonConfig, {"eps": -1.0}, "MuonConfig.eps"),
        (MuonConfig, {"adjust_lr_fn": "bogus"}, "MuonConfig.adjust_lr_fn"),
        (MuonConfig, {"ns_dtype": "float16"}, "MuonConfig.ns_dtype"),
        (ShampooConfig, {"betas": (1.0, 0.9)}, "ShampooConfig.betas[0]"),
        (ShampooConfig, {"betas": (0.9, 1.5)}, "ShampooConfig.betas[1]"),
        (ShampooConfig, {"precondition_frequency": 0}, "ShampooConfig.precondition_frequency"),
        (ShampooConfig, {"root_dtype": "bfloat16"}, "ShampooConfig.root_dtype"),
        (ShampooConfig, {"eps_mode": "max"}, "ShampooConfig.eps_mode"),
        (ShampooConfig, {"bias_correction": 1}, "ShampooConfig.bias_correction"),
        (ShampooConfig, {"start_preconditioning_step": 0}, "ShampooConfig.start_preconditioning_step"),
        (EmaGramConfig, {"eps_mode": None}, "EmaGramConfig.eps_mode"),
        (SOAPConfig, {"betas": (0.9, 1.0)}, "SOAPConfig.betas[1]"),
        (SOAPConfig, {"shampoo_beta": -0.1}, "SOAPConfig.shampoo_beta"),
        (SOAPConfig, {"eps": float("nan")}, "SOAPConfig.eps"),
        (OKLSConfig, {"beta1": 1.0}, "OKLSConfig.beta1"),
        (OKLSConfig, {"beta2": -0.5}, "OKLSConfig.beta2"),
        (OKLSConfig, {"root_method": "qr"}, "OKLSConfig.root_method"),
        (EmaGramConfig, {"precondition_frequency": 1.5}, "EmaGramConfig.precondition_frequency"),
        (EmaGramConfig, {"shape_scale": "huge"}, "EmaGramConfig.shape_scale"),
    ],
)
def test_config_validation_names_field(cls, kwargs, field):
    with pytest.raises(ValueError, match="^" + re.escape(field) + " "):
        cls(**kwargs)


def test_shampoo_beta2_one_is_sum_accumulation():
    w0, grads = _problem((8, 12), seed=11, steps=3)
    _, state = _run_lib("shampoo", ShampooConfig(betas=(0.9, 1.0)), w0, grads)
    L = sum(g.double() @ g.double().T for g in grads)
    assert torch.allclose(state["L"].double(), L, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(_BATCH_CONFIGS))
def test_step_updates_a_view_in_place(name):
    cfg = _BATCH_CONFIGS[name]
    w0, grads = _problem((16, 24), seed=12, steps=3)
    big = torch.zeros(20, 30)
    big[2:18, 3:27] = w0
    view = big[2:18, 3:27]  # non-contiguous view of a larger tensor
    _, init_fn, step_fn = FUNCTIONAL_OPTIMIZERS[name]
    state = init_fn(view, cfg)
    for t, g in enumerate(grads, start=1):
        step_fn(view, g, state, lr=LR, weight_decay=WD, step=t, initial_lr=LR, config=cfg)
    expected, _ = _run_lib(name, cfg, w0, grads)
    assert torch.allclose(big[2:18, 3:27], expected, rtol=1e-6, atol=1e-6)
    big[2:18, 3:27] = 0
    assert not big.any()


def test_defaults_follow_the_reference_implementations():
    okls = OKLSConfig()  # tilde-research/online-kl-shampoo-release, OnlineKLShampoo
    assert (okls.beta1, okls.beta2, okls.eps) == (0.9684, 0.9482, 1e-9)
    soap = SOAPConfig()  # nikhilvyas/SOAP
    assert (soap.betas, soap.eps, soap.precondition_frequency, soap.correct_bias) == (
        (0.95, 0.95), 1e-8, 10, True)
    muon = MuonConfig()  # torch.optim.Muon
    assert (muon.momentum, muon.nesterov, muon.ns_steps, muon.eps) == (0.95, True, 5, 1e-7)
    shampoo = ShampooConfig()  # Distributed Shampoo's conventions, this library's values
    assert shampoo.bias_correction and shampoo.start_preconditioning_step == -1
    assert shampoo.first_preconditioned_step == shampoo.precondition_frequency == 1


def test_configs_accept_yaml_lists_and_are_hashable():
    cfg = ShampooConfig(betas=[0.9, 0.99])
    assert cfg.betas == (0.9, 0.99)
    muon = MuonConfig(ns_coefficients=[3, -4.5, 2])
    assert muon.ns_coefficients == (3.0, -4.5, 2.0)
    assert len({cfg, muon, SOAPConfig(betas=[0.9, 0.9]), EmaGramConfig(betas=[0.5, 0.5])}) == 4
