"""DeepSeek-V3 for serving: MLA over a paged latent cache, DeepSeek MoE with pluggable all-to-all.

Numerically this is HF transformers' `DeepseekV3ForCausalLM` (the test oracle); structurally it
is a serving model: it consumes a flat `ForwardBatch` of T tokens from many requests, writes each
new token's compressed KV (`kv_lora_rank` latent + `qk_rope_head_dim` rope key) into the pool,
and computes attention
  - DECODE in the absorbed form: the query is projected into the latent space through kv_b_proj's
    key half, scores/values are taken against the cached latents directly, and the value half of
    kv_b_proj is applied after; no per-token K/V is ever expanded.
  - EXTEND in the expanded form: cached latents are expanded once per forward through kv_b_proj
    (head dims 128+64 / 128 for V3 instead of 512+64 latents: cheaper when many queries share keys).
Parameter names equal the checkpoint's, so loading is a name lookup plus the experts' own loader.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode
from engine.layers.rotary import RotaryEmbedding
from engine.mem.pool import MLATokenPool
from engine.moe.base import Dispatcher, ExpertRunner
from engine.sbo import combine_overlapping_down_gemm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def yarn_softmax_scale(cfg) -> float:
    """Softmax scale with YaRN's mscale correction (applied twice: once for q, once for k)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rp = cfg.rope_parameters
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        factor = rp["factor"]
        if factor > 1:
            m = 0.1 * rp["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        h, nh, qk = cfg.hidden_size, self.num_heads, self.nope_dim + self.rope_dim
        bias = cfg.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias=bias)
        self.rotary = rotary
        self.scale = yarn_softmax_scale(cfg)

    # -- stage 1: projections, rope, KV write (per token, no cross-request work)
    def prepare(self, x: torch.Tensor, fb: ForwardBatch, pool: MLATokenPool):
        T = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = self.rotary(fb.positions, q_pe)
        k_pe = self.rotary(fb.positions, k_pe)
        pool.write(self.layer_id, fb.out_cache_loc, latent, k_pe)
        return q_nope, q_pe

    # -- stage 2: attention over the paged cache, then o_proj
    def core(self, q_nope: torch.Tensor, q_pe: torch.Tensor, fb: ForwardBatch, pool: MLATokenPool) -> torch.Tensor:
        T = q_nope.shape[0]
        if T == 0:
            return q_nope.new_zeros(0, self.o_proj.out_features)
        if fb.forward_mode != ForwardMode.DECODE:
            out = self._extend(torch.cat([q_nope, q_pe], dim=-1), fb, pool)
            return self.o_proj(out.reshape(T, self.num_heads * self.v_dim))
        # decode, absorbed: one query per request (T == B), scored against the latents directly
        md = fb.attn
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)
        if (plan := decode_plan(fb, pool.buf.shape[-1])) is not None:
            o_lat = self._decode_split_kv(q_lat, q_pe, md, pool, *plan)
        else:  # one pass, padded to the longest request
            kv = pool.gather(self.layer_id, md.kv_indices)  # [B, S, kv_lora + rope]
            c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            scores = torch.einsum("bhc,bsc->bhs", q_lat, c_kv) + torch.einsum("bhr,bsr->bhs", q_pe, k_pe)
            scores = scores.float() * self.scale
            scores.masked_fill_(~md.kv_mask[:, None, :], float("-inf"))
            p = scores.softmax(dim=-1).to(c_kv.dtype)
            o_lat = torch.einsum("bhs,bsc->bhc", p, c_kv)
        out = torch.einsum("bhc,hvc->bhv", o_lat, w_uv)
        return self.o_proj(out.reshape(T, self.num_heads * self.v_dim))

    def _extend(self, q: torch.Tensor, fb: ForwardBatch, pool: MLATokenPool) -> torch.Tensor:
        """Expanded-form attention of the batch's new tokens `q` [T, H, nope + rope] over their
        requests' cached and new keys, one group of consecutive requests at a time (each padded
        to its own longest request, within a memory budget). Returns [T, H, v]."""
        groups = extend_groups(fb, self.num_heads * (self.nope_dim + self.rope_dim + self.v_dim))
        outs = []
        for g in groups:
            kv = pool.gather(self.layer_id, fb.attn.kv_indices[g.rows, :g.seq])  # [Bg, Sg, kv_lora + rope]
            c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            Bg, Sg = c_kv.shape[:2]
            kvb = self.kv_b_proj(c_kv).view(Bg, Sg, self.num_heads, self.nope_dim + self.v_dim)
            k_nope, v = kvb.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, :, None, :].expand(Bg, Sg, self.num_heads, self.rope_dim)], dim=-1)
            o = F.scaled_dot_product_attention(
                q[g.q_index].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=g.mask, scale=self.scale,
            )  # [Bg, H, Eg, v]
            outs.append(o.transpose(1, 2).reshape(-1, self.num_heads, self.v_dim)[g.q_src])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_split_kv(self, q_lat: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata,
                         pool: MLATokenPool, order: list[int], chunks: list[tuple[int, int, int]]) -> torch.Tensor:
        """Absorbed decode attention over key chunks with an online softmax (float32 running max,
        sum and output). Rows are taken longest first, so a chunk's rows are a prefix of that
        order and a row stops costing anything after its last key's chunk. Returns o_lat
        [B, H, kv_lora] in the original row order."""
        B, H = q_lat.shape[:2]
        perm = torch.tensor(order, dtype=torch.int64, device=q_lat.device)
        q_lat, q_pe = q_lat[perm], q_pe[perm]
        kv_indices, kv_mask = md.kv_indices[perm], md.kv_mask[perm]
        f32 = dict(dtype=torch.float32, device=q_lat.device)
        m = torch.full((B, H), float("-inf"), **f32)
        denom = torch.zeros(B, H, **f32)
        acc = torch.zeros(B, H, self.kv_lora_rank, **f32)
        for start, end, n in chunks:
            kv = pool.gather(self.layer_id, kv_indices[:n, start:end])
            c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            scores = torch.einsum("bhc,bsc->bhs", q_lat[:n], c_kv) + torch.einsum("bhr,bsr->bhs", q_pe[:n], k_pe)
            scores = scores.float() * self.scale
            scores.masked_fill_(~kv_mask[:n, None, start:end], float("-inf"))
            # every row in a chunk has a real key there, so the new max is finite
            m_new = torch.maximum(m[:n], scores.amax(-1))
            rescale = torch.exp(m[:n] - m_new)
            p = torch.exp(scores - m_new[..., None])
            denom[:n] = denom[:n] * rescale + p.sum(-1)
            acc[:n] = acc[:n] * rescale[..., None] + torch.einsum("bhs,bsc->bhc", p.to(c_kv.dtype), c_kv).float()
            m[:n] = m_new
        out = torch.empty_like(acc)
        out[perm] = acc / denom[..., None]
        return out.to(q_lat.dtype)


# Decode attention gathers [rows, keys, kv_lora + rope] cached latents. Past this many elements
# per gather it runs in key chunks instead of one pass padded to the longest request (one long
# request among short ones would otherwise cost every row its length, in memory and in work).
# Large on CUDA, where each chunk costs a dozen kernel launches; small on CPU, where it does not.
DECODE_GATHER_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 24}
_DECODE_MIN_CHUNK = 256


def plan_decode_chunks(seq_lens: list[int], width: int, budget: int,
                       min_chunk: int = _DECODE_MIN_CHUNK) -> tuple[list[int], list[tuple[int, int, int]]] | None:
    """Split-KV plan for decode attention over requests of `seq_lens` keys: the row order
    (longest first) and key chunks (start, end, rows), each chunk's rows being the longest `rows`
    (those with a key at or past `start`), each chunk about `budget` elements of `width`. None when
    one padded pass fits the budget."""
    B, longest = len(seq_lens), max(seq_lens)
    if B * longest * width <= budget:
        return None
    order = sorted(range(B), key=lambda i: -seq_lens[i])
    desc = [seq_lens[i] for i in order]
    chunks, start, n = [], 0, B
    while start < longest:
        while desc[n - 1] <= start:
            n -= 1
        end = min(longest, start + max(min_chunk, budget // (n * width)))
        chunks.append((start, end, n))
        start = end
    return order, chunks


# Extend attention pads each group of requests to its longest one: expanded keys and values
# [rows, keys, heads x (nope + rope + v)] and the causal mask [rows, new tokens, keys]. A group
# takes consecutive requests while both stay within this many elements (a request alone may pass
# it: its own keys are needed at once).
EXTEND_GROUP_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 26}


@dataclass
class ExtendGroup:
    rows: slice  # requests of the batch
    seq: int  # the longest request's keys (cached + new)
    q_index: torch.Tensor  # [Bg, Eg] token of the batch for each (request, new token); padding repeats the last
    q_src: torch.Tensor  # [Tg] row of the flattened [Bg * Eg] output for each of the group's tokens
    mask: torch.Tensor  # [Bg, 1, Eg, Sg] causal: key position <= query position


def plan_extend_groups(prefix_lens: list[int], extend_lens: list[int], key_elems: int,
                       budget: int) -> list[tuple[int, int]]:
    """Consecutive request ranges [r0, r1) whose padded keys (rows x longest x `key_elems`) and
    mask (rows x most new tokens x longest) stay within `budget` elements; at least one request."""
    groups, r0 = [], 0
    while r0 < len(prefix_lens):
        r1, seq, ext = r0 + 1, prefix_lens[r0] + extend_lens[r0], extend_lens[r0]
        while r1 < len(prefix_lens):
            s, e = max(seq, prefix_lens[r1] + extend_lens[r1]), max(ext, extend_lens[r1])
            if (r1 + 1 - r0) * s * max(key_elems, e) > budget:
                break
            r1, seq, ext = r1 + 1, s, e
        groups.append((r0, r1))
        r0 = r1
    return groups


def extend_groups(fb: ForwardBatch, key_elems: int) -> list[ExtendGroup]:
    """The extend batch's request groups with their device-side query layouts and causal masks,
    built at the first layer and kept on the batch's metadata for the others."""
    md = fb.attn
    if md.layer_plan is not None:
        return md.layer_plan[0]
    device = md.kv_indices.device
    budget = EXTEND_GROUP_ELEMS.get(device.type, EXTEND_GROUP_ELEMS["cuda"])
    prefix, ext = fb.prefix_lens, fb.extend_lens
    groups, t0 = [], 0
    for r0, r1 in plan_extend_groups(prefix, ext, key_elems, budget):
        e = torch.tensor(ext[r0:r1], dtype=torch.int64)
        E, S = int(e.max()), max(p + x for p, x in zip(prefix[r0:r1], ext[r0:r1]))
        e_ar = torch.arange(E)
        starts = t0 + torch.cumsum(e, 0) - e
        q_index = starts[:, None] + torch.minimum(e_ar[None, :], e[:, None] - 1)
        q_src = (e_ar[None, :] < e[:, None]).flatten().nonzero().squeeze(1)
        q_pos = md.prefix[r0:r1, None] + torch.arange(E, device=device)[None, :]  # device: no host mask
        mask = torch.arange(S, device=device)[None, None, :] <= q_pos[:, :, None]
        groups.append(ExtendGroup(slice(r0, r1), S, q_index.to(device, non_blocking=True),
                                  q_src.to(device, non_blocking=True), mask[:, None]))
        t0 += int(e.sum())
    md.layer_plan = (groups,)
    return groups


def decode_plan(fb: ForwardBatch, width: int) -> tuple[list[int], list[tuple[int, int, int]]] | None:
    """`plan_decode_chunks` for a decode batch, from its host-side lengths (a batch without them,
    such as a CUDA graph's static one, runs one padded pass); planned at the first layer."""
    md = fb.attn
    if md.layer_plan is not None:
        return md.layer_plan[0]
    plan = None
    if fb.prefix_lens and len(fb.prefix_lens) == fb.batch_size:
        budget = DECODE_GATHER_ELEMS.get(md.kv_indices.device.type, DECODE_GATHER_ELEMS["cuda"])
        plan = plan_decode_chunks([p + e for p, e in zip(fb.prefix_lens, fb.extend_lens)], width, budget,
                                  _DECODE_MIN_CHUNK)
    md.layer_plan = (plan,)
    return plan


class TopkRouter(nn.Module):
    """DeepSeek-V3 gate: sigmoid scores, bias-corrected group-limited top-k, normalized, scaled."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            T = x.shape[0]
            grouped = choice.view(T, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(T, self.num_experts), float("-inf"))
        topk_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        return topk_ids, topk_weights * self.routed_scaling_factor


class RoutedExperts(nn.Module):
    """This rank's routed experts as fused tensors; knows which checkpoint experts belong here.

    `w13` [E_local, 2I, H] holds gate rows then up rows, `w2` [E_local, H, I]. With
    `keep_fp8()` (an FP8 checkpoint run by an FP8 expert runner) the weights stay in the
    checkpoint's float8_e4m3fn with their 128x128 block scales `w13_scale`/`w2_scale`, as loaded.
    """

    _NAME = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
    _PROJ = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg, expert_range: tuple[int, int]) -> None:
        super().__init__()
        self.expert_range = expert_range
        n = expert_range[1] - expert_range[0]
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        self.inter, self.hidden = inter, hidden
        self.w13 = nn.Parameter(torch.empty(n, 2 * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden, inter), requires_grad=False)
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        self.loaded = torch.zeros(n, 3, dtype=torch.bool, device="cpu")  # bookkeeping: on the host even under "meta"

    def keep_fp8(self, block: int = 128) -> None:
        if self.inter % block:
            raise ValueError(f"FP8 experts need moe_intermediate_size divisible by {block} "
                             "(gate and up scales are stacked)")
        n, cdiv = self.w13.shape[0], lambda a: -(-a // block)
        fp8 = torch.float8_e4m3fn
        self.w13 = nn.Parameter(torch.empty(n, 2 * self.inter, self.hidden, dtype=fp8), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, self.hidden, self.inter, dtype=fp8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(n, 2 * cdiv(self.inter), cdiv(self.hidden)), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(n, cdiv(self.hidden), cdiv(self.inter)), requires_grad=False)
        self.loaded = torch.zeros(n, 6, dtype=torch.bool, device="cpu")

    def owns(self, global_expert: int) -> bool:
        return self.expert_range[0] <= global_expert < self.expert_range[1]

    def load(self, suffix: str, tensor: torch.Tensor) -> bool:
        """Load `experts.{j}.{proj}.weight[_scale_inv]`; False if it is not an expert tensor."""
        m = self._NAME.search(suffix)
        if m is None:
            return False
        j, proj, kind = int(m.group(1)), m.group(2), m.group(3)
        if not self.owns(j):
            raise ValueError(f"expert {j} does not belong to range {self.expert_range}")
        e = j - self.expert_range[0]
        is_scale = kind == "weight_scale_inv"
        if is_scale and self.w13_scale is None:
            raise ValueError(f"unexpected FP8 scale {suffix!r} for experts kept in {self.w13.dtype}")
        if is_scale:
            w13, w2, half = self.w13_scale, self.w2_scale, self.w13_scale.shape[1] // 2
        else:
            w13, w2, half = self.w13, self.w2, self.inter
        if proj == "gate_proj":
            w13.data[e, :half].copy_(tensor)
        elif proj == "up_proj":
            w13.data[e, half:].copy_(tensor)
        else:
            w2.data[e].copy_(tensor)
        self.loaded[e, self._PROJ.index(proj) + (3 if is_scale else 0)] = True
        return True


class MoE(nn.Module):
    def __init__(self, cfg, expert_range: tuple[int, int]) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = RoutedExperts(cfg, expert_range)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )
        # set by the model runner once the communication backends exist: one dispatcher per
        # micro-batch (under TBO two steps are in flight between their halves at once)
        self.dispatchers: list[Dispatcher] = []
        self.runner: ExpertRunner | None = None
        self.sbo = False  # single-batch overlap: shared experts inside the communication windows
        self.alt_stream = None  # CUDA: SBO runs the shared experts on this side stream
        # SBO with the signalled combine (DeepEP LL + DeepGEMM fork on SM90): (comm SMs, GEMM SMs)
        self.combine_signal_sms: tuple[int, int | None] | None = None


YIELD = object()  # in an operation list: the end of a stage, where the other micro-batch may run


class CommStats:
    """Time spent blocked in the `*_b` (wait) halves of the MoE all-to-all."""

    __slots__ = ("wait_s",)

    def __init__(self) -> None:
        self.wait_s = 0.0


class MicroBatch:
    """State of one micro-batch flowing through the layers' stages (TBO runs two of these)."""

    __slots__ = ("fb", "index", "x", "residual", "h", "q_nope", "q_pe", "topk_ids", "topk_weights",
                 "shared", "shared_act", "stats", "tbo")

    def __init__(self, fb: ForwardBatch, index: int, x: torch.Tensor, stats: CommStats | None = None,
                 tbo: bool = False) -> None:
        self.fb, self.index, self.x, self.stats, self.tbo = fb, index, x, stats, tbo
        self.residual = self.h = self.q_nope = self.q_pe = None
        self.topk_ids = self.topk_weights = self.shared = self.shared_act = None


def _timed_wait(mb: MicroBatch, fn):
    if mb.stats is None:
        return fn()
    t0 = time.perf_counter()
    out = fn()
    mb.stats.wait_s += time.perf_counter() - t0
    return out


class DecoderLayer(nn.Module):
    """A decoder layer as a list of operations with yield points; TBO interleaves two
    micro-batches' stages (the runs of operations between yields, across layers).

    MoE layer, decode (B lags A by 2 stages), yields after:
      attn prepare | attn core + expert selection | dispatch launch + shared experts
      | dispatch wait + experts + combine launch | combine wait
    MoE layer, extend (B lags A by 0), yields after dispatch launch and combine launch only, so a
      stage runs from one layer's combine wait through the next layer's attention to its dispatch
      launch: A's combine is covered by B's experts, B's by A's next attention.
    Shared experts run inside the dispatch window under TBO (whole) and SBO (up half there, down
    half in the combine window); otherwise after the combine. A dense layer has no yield point.
    Run back to back, the stages are the plain forward.
    """

    def __init__(self, cfg, layer_id: int, rotary: RotaryEmbedding, expert_range: tuple[int, int]) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_id, rotary)
        self.is_moe = layer_id >= cfg.first_k_dense_replace
        self.mlp = MoE(cfg, expert_range) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pool: MLATokenPool | None = None  # set by the model runner

    # -- operations (each takes the micro-batch it advances)
    def _attn_prepare(self, mb: MicroBatch) -> None:
        mb.residual = mb.x
        mb.q_nope, mb.q_pe = self.self_attn.prepare(self.input_layernorm(mb.x), mb.fb, self.pool)

    def _attn_core(self, mb: MicroBatch) -> None:
        mb.x = mb.residual + self.self_attn.core(mb.q_nope, mb.q_pe, mb.fb, self.pool)
        mb.q_nope = mb.q_pe = mb.residual = None
        mb.h = self.post_attention_layernorm(mb.x)

    def _dense_layer(self, mb: MicroBatch) -> None:
        self._attn_prepare(mb)
        self._attn_core(mb)
        mb.x = mb.x + self.mlp(mb.h)
        mb.h = None

    def _select_experts(self, mb: MicroBatch) -> None:
        mb.topk_ids, mb.topk_weights = self.mlp.gate(mb.h)

    @contextlib.contextmanager
    def _side(self):
        """SBO on CUDA: shared-expert kernels on the side stream, concurrent with communication
        and the routed GEMMs on the main stream. Elsewhere a no-op."""
        alt = self.mlp.alt_stream
        if alt is None:
            yield
            return
        alt.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(alt):
            yield

    def _dispatch_a(self, mb: MicroBatch) -> None:
        self.mlp.dispatchers[mb.index].dispatch_a(mb.h, mb.topk_ids, mb.topk_weights)
        shared = self.mlp.shared_experts
        if shared is None:
            return
        if self.mlp.sbo:
            with self._side():
                mb.shared_act = F.silu(shared.gate_proj(mb.h)) * shared.up_proj(mb.h)
        elif mb.tbo:
            mb.shared = shared(mb.h)

    def _experts(self, mb: MicroBatch) -> None:
        disp = self.mlp.dispatchers[mb.index]
        d = _timed_wait(mb, disp.dispatch_b)
        sms, runner = self.mlp.combine_signal_sms, self.mlp.runner
        if sms is not None and disp.accepts_combine_signal(d) and runner.signals_down_gemm(d):
            combine_overlapping_down_gemm(disp, runner, d, *sms)  # combine_a inside
        else:
            disp.combine_a(runner(d), d)
        if mb.shared_act is not None:
            with self._side():
                mb.shared = self.mlp.shared_experts.down_proj(mb.shared_act)
            mb.shared_act = None

    def _combine_b(self, mb: MicroBatch) -> None:
        out = _timed_wait(mb, self.mlp.dispatchers[mb.index].combine_b)
        shared = self.mlp.shared_experts
        if self.mlp.alt_stream is not None and mb.shared is not None:
            main = torch.cuda.current_stream()
            main.wait_stream(self.mlp.alt_stream)
            mb.shared.record_stream(main)  # allocated on the side stream, consumed on main
            mb.h.record_stream(self.mlp.alt_stream)  # read on the side stream, freed on main
        if shared is not None:  # without SBO the shared experts run here, after communication
            out = out + (mb.shared if mb.shared is not None else shared(mb.h))
        mb.x = mb.x + out
        mb.h = mb.shared = mb.topk_ids = mb.topk_weights = None

    def operations(self, mode: ForwardMode) -> list:
        """This layer's operations in order, with `YIELD` where a stage ends."""
        if not self.is_moe:
            return [self._dense_layer]
        if mode == ForwardMode.DECODE:
            return [self._attn_prepare, YIELD, self._attn_core, self._select_experts, YIELD,
                    self._dispatch_a, YIELD, self._experts, YIELD, self._combine_b, YIELD]
        return [self._attn_prepare, self._attn_core, self._select_experts, self._dispatch_a, YIELD,
                self._experts, YIELD, self._combine_b]


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg, max_positions: int, expert_range: tuple[int, int]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg, max_positions, bool(getattr(cfg, "rope_interleave", True)))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, rotary, expert_range) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg, *, max_positions: int, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        if cfg.n_routed_experts % world_size:
            raise ValueError(
                f"ep_size: {world_size} does not divide n_routed_experts={cfg.n_routed_experts}"
            )
        per_rank = cfg.n_routed_experts // world_size
        self.expert_range = (rank * per_rank, (rank + 1) * per_rank)
        self.config = cfg
        self.model = DeepseekV3Model(cfg, max_positions, self.expert_range)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if layer.is_moe]

    @staticmethod
    def stage_list(layers: Iterable[DecoderLayer], mode: ForwardMode) -> list[list]:
        """The layers' operations cut at their yield points into stages (lists of operations on
        one MicroBatch); a stage may span the end of one layer and the start of the next."""
        stages, cur = [], []
        for layer in layers:
            for op in layer.operations(mode):
                if op is YIELD:
                    stages.append(cur)
                    cur = []
                else:
                    cur.append(op)
        if cur:
            stages.append(cur)
        return stages

    def _run(self, layers, mb: MicroBatch) -> None:
        for stage in self.stage_list(layers, mb.fb.forward_mode):
            for op in stage:
                op(mb)

    def hidden_states(self, fb: ForwardBatch, stats: CommStats | None = None) -> torch.Tensor:
        mb = MicroBatch(fb, 0, self.model.embed_tokens(fb.input_ids), stats)
        self._run(self.model.layers, mb)
        return self.model.norm(mb.x)

    def hidden_states_tbo(self, fb: ForwardBatch, delta: int, stats: CommStats | None = None) -> torch.Tensor:
        """`fb`'s dense layers on the whole batch, then its two micro-batches (`fb.tbo_children`,
        tokens [0, t) and [t, T)) through the MoE layers' interleaved stages; outputs back in
        token order."""
        from engine.tbo import run_interleaved

        a, b = fb.tbo_children
        k = self.config.first_k_dense_replace  # DeepSeek-V3: dense layers first, MoE after
        whole = MicroBatch(fb, 0, self.model.embed_tokens(fb.input_ids), stats)
        self._run(self.model.layers[:k], whole)
        t = a.num_tokens
        mbs = [MicroBatch(child, i, x, stats, tbo=True)
               for i, (child, x) in enumerate(((a, whole.x[:t]), (b, whole.x[t:])))]
        run_interleaved(self.stage_list(self.model.layers[k:], fb.forward_mode), mbs, delta)
        return self.model.norm(torch.cat([mbs[0].x, mbs[1].x]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- loading
    _LAYER = re.compile(r"^model\.layers\.(\d+)\.")
    _EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")

    def wants(self, name: str) -> bool:
        """Whether this rank needs checkpoint tensor `name` (other ranks' experts are skipped unread)."""
        m = self._EXPERT.match(name)
        if m is not None:
            return self.expert_range[0] <= int(m.group(2)) < self.expert_range[1]
        return True

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into place. Routed experts go through their own loader. Other
        FP8 weights arriving with their block scales (checkpoints read with keep_fp8) are copied
        as stored into an `Fp8Linear`, or dequantized here, once both halves have arrived, for a
        layer kept in the activation dtype."""
        from engine.models.loader import dequantize_fp8_blockwise

        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        seen: set[str] = set()
        fp8_pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors:
            m = self._EXPERT.match(name)
            if m is not None:
                layer = self.model.layers[int(m.group(1))]
                layer.mlp.experts.load(name, t)
                continue
            target = params.get(name)
            kept_fp8 = target is not None and target.dtype == t.dtype  # an Fp8Linear's weight or scale
            if (name.endswith(".weight_scale_inv") or t.dtype == torch.float8_e4m3fn) and not kept_fp8:
                base = name.removesuffix("_scale_inv")
                part = fp8_pending.setdefault(base, {})
                part["scale" if name.endswith("_scale_inv") else "weight"] = t
                if len(part) < 2:
                    continue
                name, t = base, dequantize_fp8_blockwise(part["weight"], part["scale"])
                del fp8_pending[base]
            target = params.get(name)
            if target is None:
                target = buffers.get(name)
            if target is None:
                raise ValueError(f"model: unexpected tensor {name!r} in checkpoint")
            if target.shape != t.shape:
                raise ValueError(f"model: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(target.shape)}")
            target.data.copy_(t)
            seen.add(name)
        if fp8_pending:
            raise ValueError(f"model: FP8 weights without their scales: {sorted(fp8_pending)[:5]}")
        missing = [n for n in params if n not in seen and ".experts.w" not in n]
        missing += [n for n in buffers if n.endswith("e_score_correction_bias") and n not in seen]
        for moe in self.moe_layers:
            if not bool(moe.experts.loaded.all()):
                missing.append(f"experts of a MoE layer in range {moe.experts.expert_range}")
        if missing:
            raise ValueError(f"model: checkpoint is missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
