"""Meta-device init: every matrix independent of the others and the same at every world size.

The rule ([Note: matrix init RNG]): after ``to_empty`` each owner draws each matrix from the
matrix's own stream, seeded from the default seed and the FQN. Every world's gathered matrices
must equal, bit for bit, values computed in one process with the documented rule (one
``matrix_init_generator(fqn, seed)`` per matrix, passed as ``generator=`` to its draws in order),
so worlds 1, 2 and 4 agree with each other.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import itertools
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import matrixfsdp as mf
from matrixfsdp.runtime.init_rng import matrix_init_generator, matrix_init_seed

from .checks import assert_close_dicts, full_values, reference_values
from .dist_utils import DEVICES, run_subtests, run_world, test_device
from .models import TinyTransformer, global_batch, lm_loss, local_batch

SEED = 1234
PARAM_RTOL = 1e-5
HIDDEN = 48
TRUNC_STD, TRUNC_CUT = 0.02, 0.03  # attn.o: truncated at 1.5 std, so trunc_normal_ resamples

GeneratorFor = Callable[[str], torch.Generator | None]


def _no_generator(fqn: str) -> None:
    return None  # the wrapped model's draws: intercepted, on the matrix's stream


# -- the init code every rank runs (reset_parameters, then torchtitan and Hugging Face styles) --
def _reset_all(model: nn.Module, generator_for: GeneratorFor = _no_generator) -> None:
    """``reset_parameters()`` on every module; with a generator, what it draws for the weight."""
    with warnings.catch_warnings():  # nn.init warns on a non-owner's empty placeholder
        warnings.simplefilter("ignore", UserWarning)
        for name, module in model.named_modules():
            generator = generator_for(f"{name}.weight")
            if generator is not None and isinstance(module, nn.Linear):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
            elif isinstance(module, (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding)):
                module.reset_parameters()


def _init_weights(model: nn.Module, generator_for: GeneratorFor = _no_generator) -> None:
    """trunc_normal_ (both of its sampling paths), ``.data.normal_()`` and ``orthogonal_``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        nn.init.normal_(model.embed.weight)
        for i, block in enumerate(model.layers):
            prefix = f"layers.{i}"
            for name in ("q", "k", "v"):  # torchtitan
                nn.init.trunc_normal_(getattr(block.attn, name).weight, std=TRUNC_STD,
                                      generator=generator_for(f"{prefix}.attn.{name}.weight"))
            nn.init.trunc_normal_(block.attn.o.weight, std=TRUNC_STD, a=-TRUNC_CUT, b=TRUNC_CUT,
                                  generator=generator_for(f"{prefix}.attn.o.weight"))
            block.up.weight.data.normal_(mean=0.0, std=TRUNC_STD,  # Hugging Face _init_weights
                                         generator=generator_for(f"{prefix}.up.weight"))
            nn.init.orthogonal_(block.down.weight, generator=generator_for(f"{prefix}.down.weight"))
        nn.init.trunc_normal_(model.head.weight, std=TRUNC_STD)


def _expected(fqns: list[str], passes: list[tuple[int, list[Callable]]]) -> dict[str, torch.Tensor]:
    """The matrices by the documented rule, in one process: for each ``(seed, init functions)``
    pass, one fresh stream per matrix, continued across that pass's functions."""
    torch.manual_seed(0)  # the tail's values do not matter here
    model = TinyTransformer(hidden=HIDDEN)
    for seed, init_fns in passes:
        generators = {fqn: matrix_init_generator(fqn, seed, test_device()) for fqn in fqns}
        for init in init_fns:
            init(model, generators.get)
    named = dict(model.named_parameters())
    return {fqn: named[fqn].detach().cpu() for fqn in fqns}


# -- subtests -----------------------------------------------------------------------------------
def _meta_model() -> nn.Module:
    with torch.device("meta"):
        model = TinyTransformer(hidden=HIDDEN)
    mf.fully_shard_matrix(model)
    model.to_empty(device=test_device())
    return model


def _assert_in_window(model: nn.Module, open_: bool) -> None:
    for fqn, mp in mf.get_state(model).params.items():
        assert isinstance(mp.sharded, nn.Parameter), fqn
        in_window = type(mp.sharded) is not nn.Parameter
        assert in_window == (open_ and mp.is_owner), (fqn, type(mp.sharded), mp.is_owner)
        if not open_:
            assert type(mp.sharded.data) is torch.Tensor, fqn


def _assert_distribution(values: dict[str, torch.Tensor]) -> None:
    """Each kind of init has its distribution (Kaiming bounds, std, truncation, orthogonality)."""
    bound = 1.0 / math.sqrt(16)  # kaiming_uniform_(a=√5) of fan-in 16
    trunc_std = TRUNC_STD * math.sqrt(1 - 2 * 1.5 * math.exp(-1.125) / math.sqrt(2 * math.pi)
                                      / math.erf(1.5 / math.sqrt(2)))
    for fqn, w in values.items():
        kind = fqn.split(".")[-2]
        if kind == "unused":
            assert 0.8 * bound <= w.abs().max() <= bound, fqn
            assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.25, (fqn, w.std())
        elif kind in ("q", "k", "v", "up"):
            assert abs(w.std().item() / TRUNC_STD - 1) < 0.2, (fqn, w.std())
        elif kind == "o":
            assert w.abs().max() <= TRUNC_CUT, fqn
            assert abs(w.std().item() / trunc_std - 1) < 0.2, (fqn, w.std())
        elif kind == "down":  # (16, 48): orthonormal rows
            torch.testing.assert_close(w @ w.T, torch.eye(16), atol=1e-5, rtol=0)


def _independent_and_invariant(rank: int, world: int) -> None:
    model = _meta_model()
    state = mf.get_state(model)
    fqns = list(state.params)
    _assert_in_window(model, True)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)  # built inside the window: same objects
    torch.manual_seed(SEED)
    _reset_all(model)
    _init_weights(model)
    assert torch.initial_seed() == SEED  # the default generator's seed is left as set
    values = full_values(model)
    matrices = {fqn: values[fqn] for fqn in fqns}
    # (i) no two matrices are equal (same-shape ones would be, drawn first on different owners)
    for (a, wa), (b, wb) in itertools.combinations(matrices.items(), 2):
        assert wa.shape != wb.shape or not torch.equal(wa, wb), f"{a} equals {b}"
    # (ii) every matrix as the rule gives it, bit for bit, hence the same at every world size
    want = _expected(fqns, [(SEED, [_reset_all, _init_weights])])
    for fqn in fqns:
        assert torch.equal(matrices[fqn], want[fqn]), f"{fqn} differs from the rule's values"
    _assert_distribution(matrices)
    # another seed restarts each matrix's stream from that seed (unused: not drawn again)
    torch.manual_seed(SEED + 1)
    _init_weights(model)
    values = full_values(model)
    want.update({fqn: w for fqn, w in _expected(fqns, [(SEED + 1, [_init_weights])]).items()
                 if "unused" not in fqn})
    for fqn in fqns:
        assert torch.equal(values[fqn], want[fqn]), f"{fqn} after re-seeding"
    _assert_trains_like_reference(model, opt, values, rank, world)


def _assert_trains_like_reference(model: nn.Module, opt: torch.optim.Optimizer,
                                  initial: dict[str, torch.Tensor], rank: int, world: int) -> None:
    """(iv) the window closes at the first forward; training matches one process started from
    the same values."""
    state = mf.get_state(model)
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert all(id(mp.sharded) in held for mp in state.params.values())
    reference = TinyTransformer(hidden=HIDDEN)
    reference.load_state_dict({k: v.to(test_device()) for k, v in initial.items()})
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    for step in range(3):
        tokens = global_batch(step)
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        if step == 0:
            _assert_in_window(model, False)
        lm_loss(reference, tokens).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_close_dicts(full_values(model), reference_values(reference), PARAM_RTOL, "param")


def _window_ends(rank: int, world: int) -> None:
    """quiesce() ends the window; an eager-built model has none; draws after it use the default
    generator again."""
    model = _meta_model()
    model.float()  # another nn.Module._apply inside the window keeps it open
    _assert_in_window(model, True)
    owned = [mp for mp in mf.get_state(model).params.values() if mp.is_owner]
    for mp in owned:  # copies and pickles of derived tensors are plain tensors
        derived = mp.sharded.data
        assert type(derived) is not torch.Tensor and type(copy.deepcopy(derived)) is torch.Tensor
        buffer = io.BytesIO()
        torch.save(derived, buffer)
        buffer.seek(0)
        assert type(torch.load(buffer, weights_only=True)) is torch.Tensor
    mf.quiesce(model)
    _assert_in_window(model, False)
    if owned:
        torch.manual_seed(SEED)
        owned[0].sharded.data.normal_()
        torch.manual_seed(SEED)
        plain = torch.empty(owned[0].shape, device=test_device()).normal_()
        assert torch.equal(owned[0].sharded.detach(), plain)
    torch.manual_seed(0)
    eager = mf.fully_shard_matrix(TinyTransformer(hidden=HIDDEN))
    _assert_in_window(eager, False)


def _world(rank: int, world: int) -> None:
    run_subtests(rank, {
        "independent_and_invariant": functools.partial(_independent_and_invariant, rank, world),
        "window_ends": functools.partial(_window_ends, rank, world),
    })


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_meta_init(device: str, world: int) -> None:
    run_world(world, _world, device=device)


def test_matrix_init_seed_is_the_documented_hash() -> None:
    digest = hashlib.sha256(b"7:layers.0.attn.q.weight").digest()
    assert matrix_init_seed(7, "layers.0.attn.q.weight") == int.from_bytes(digest[:8], "big")
    assert matrix_init_generator("a", 7).initial_seed() == matrix_init_seed(7, "a")
