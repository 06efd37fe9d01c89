"""A tiny top-k MoE whose experts run under expert parallelism (EP), for the EP tests.

``TinyEPMoE`` routes each token to its top-2 experts. Without an ep group every expert is local
(the single-process reference); after ``distribute_experts(model, ep_mesh)`` each expert stack is
a DTensor ``Shard(0)`` over ``ep`` and each block dispatches its tokens to the experts' ep ranks
with a differentiable all-to-all and combines what comes back, as torchtitan's
``AllToAllTokenDispatcher`` does. The same global batch gives the same math either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

from .models import VOCAB

EXPERTS = 4
TOP_K = 2


class Experts(nn.Module):
    """``E`` two-layer experts as stacks ``(E, out, in)``; computes tokens sorted by expert."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w_in, w_out = (w.to_local() if isinstance(w, DTensor) else w
                       for w in (self.w_in, self.w_out))
        outs = []
        for e, chunk in enumerate(torch.split(x, counts)):
            outs.append(F.gelu(chunk @ w_in[e].T) @ w_out[e].T)
        return torch.cat(outs)


class MoEBlock(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 24, experts: int = EXPERTS) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim, hidden)
        self.num_experts = experts
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm(x).reshape(-1, d)
        top, index = self.gate(h).topk(TOP_K, dim=-1)
        weights = F.softmax(top, dim=-1).reshape(-1, 1)
        token_of = torch.arange(h.shape[0], device=h.device).repeat_interleave(TOP_K)
        expert_of = index.reshape(-1)
        order = torch.argsort(expert_of, stable=True)
        routed = h[token_of[order]]
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        out = self._dispatch(routed, counts) if self.ep_group is not None \
            else self.experts(routed, counts.tolist())
        weighted = (out * weights[order]).to(h.dtype)  # mixed precision: experts may compute in bf16
        combined = torch.zeros_like(h).index_add(0, token_of[order], weighted)
        return x + combined.reshape(b, t, d)

    def _dispatch(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each routed token to its expert's ep rank, compute there, bring it back."""
        group = self.ep_group
        ep = dist.get_world_size(group)
        local = self.num_experts // ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        send = counts.view(ep, local).sum(1).tolist()
        by_source = received_counts.view(ep, local)  # [source ep rank, local expert]
        recv = by_source.sum(1).tolist()
        inbound = dist_fn.all_to_all_single(
            routed.new_empty(sum(recv), routed.shape[1]), routed, recv, send, group=group)
        # Regroup (source, expert) blocks expert-major, compute, and restore the order.
        starts = torch.cumsum(by_source.flatten(), 0) - by_source.flatten()
        blocks = [torch.arange(int(starts[s * local + e]), int(starts[s * local + e])
                               + int(by_source[s, e]), device=routed.device)
                  for e in range(local) for s in range(ep)]
        perm = torch.cat(blocks)
        computed = self.experts(inbound[perm], by_source.sum(0).tolist())
        restored = torch.empty_like(computed).index_copy(0, perm, computed)
        return dist_fn.all_to_all_single(routed.new_empty(routed.shape), restored, send, recv,
                                         group=group)


class TinyEPMoE(nn.Module):
    """``reentrant``: ``None`` computes each block plainly, ``True``/``False`` checkpoints it."""

    def __init__(self, layers: int = 2, dim: int = 16, reentrant: bool | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(MoEBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x) if self.reentrant is None else checkpoint(
                layer, x, use_reentrant=self.reentrant)
        return self.head(x)


def distribute_experts(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Put every expert stack on ``ep_mesh`` as ``Shard(0)`` and dispatch over its group."""
    for module in model.modules():
        if isinstance(module, MoEBlock):
            module.ep_group = ep_mesh.get_group(0)
        if isinstance(module, Experts):
            for name, param in list(module.named_parameters(recurse=False)):
                dt = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
    return model


EXPERT_FQNS = tuple(f"layers.{i}.experts.{w}" for i in range(2) for w in ("w_in", "w_out"))


# -- a Hugging Face MoE under EP: an all-to-all dispatch around its own experts ---------------------
def hf_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Distribute every Hugging Face fused-experts module (``gate_up_proj``/``down_proj`` stacks,
    e.g. Qwen3-MoE's) ``Shard(0)`` over ``ep_mesh`` and route its tokens there with an
    all-to-all; the experts' own forward computes each rank's local experts."""
    import functools

    group = ep_mesh.get_group(0)
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and \
                isinstance(module.gate_up_proj, nn.Parameter):
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(module, name)
                dt = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
            module.forward = functools.partial(_hf_ep_forward, module, group)
    return model


def _hf_ep_forward(module: nn.Module, group: dist.ProcessGroup, hidden: torch.Tensor,
                   top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    from types import SimpleNamespace

    experts, k = module.num_experts, top_k_index.shape[-1]
    ep = dist.get_world_size(group)
    local = experts // ep
    expert_of = top_k_index.reshape(-1)
    token_of = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    send = counts.view(ep, local).sum(1).tolist()
    by_source = received.view(ep, local)
    recv = by_source.sum(1).tolist()
    routed = hidden[token_of[order]]
    inbound = dist_fn.all_to_all_single(routed.new_empty(sum(recv), routed.shape[1]), routed,
                                        recv, send, group=group)
    local_index = torch.cat([torch.full((int(by_source[s, e]),), e, dtype=torch.long,
                                        device=hidden.device)
                             for s in range(ep) for e in range(local)])
    shim = SimpleNamespace(num_experts=local, gate_up_proj=module.gate_up_proj.to_local(),
                           down_proj=module.down_proj.to_local(), act_fn=module.act_fn)
    own_forward = type(module).forward.__wrapped__  # Hugging Face's eager expert loop
    out = own_forward(shim, inbound, local_index.unsqueeze(1),
                      torch.ones(inbound.shape[0], 1, dtype=inbound.dtype, device=inbound.device))
    back = dist_fn.all_to_all_single(routed.new_empty(routed.shape), out, send, recv, group=group)
    weights = top_k_weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(hidden).index_add(0, token_of[order], (back * weights).to(hidden.dtype))
