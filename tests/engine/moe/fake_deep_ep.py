"""A CPU stand-in for `deep_ep` (V1 `Buffer` API) that follows the documented semantics.

Multi-rank over any torch.distributed group (gloo in the tests): the exchange is an
`all_gather_object`, so it is slow but obviously right, which is what an oracle should be. What it
holds the adapter to (asserts), from DeepEP's docs and kernels:
- normal mode: BF16 or (FP8, float32 [T, hidden/128]) payloads; `topk_idx` of `topk_idx_t`;
  receive = one row per (token, rank), ordered by source rank then token, `recv_topk_idx` local
  with -1 elsewhere (weights 0 there); per-expert counts padded to `expert_alignment`; `combine`
  sums rows back per token without weights; `allocate_on_comm_stream` needs `previous_event`.
- low-latency mode: `clean_low_latency_buffer` required after normal kernels; hidden in DeepEP's
  supported set (FP8: multiple of 512), top-k <= 11, T <= num_max_dispatch_tokens_per_rank;
  `async_finish` and `return_recv_hook` exclusive; masked layout [E_local, W*num_max, hidden] with
  `recv_count` int32, FP8 scales MN-major; `low_latency_combine` reduces with `topk_weights`.
- results arrive only when waited for: received tensors hold NaN until the hook is called (or the
  event waited on, with `async_finish`), so an adapter that reads early gets NaN, not the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

topk_idx_t = torch.int64
_LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
_SUPPORTED_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)


def _quant_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Written independently of engine.moe.fp8 on purpose: the stand-in is an oracle.
    xb = x.float().reshape(x.shape[0], x.shape[1] // 128, 128)
    s = xb.abs().amax(-1).clamp_min(1e-4) / 448.0
    return (xb / s.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(x.shape), s


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.nvl_recv = num_max_nvl_chunked_recv_tokens
        self.rdma_recv = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * self.nvl_recv * num_ranks

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0 if num_ranks <= 8 else hidden_bytes * self.rdma_recv * num_ranks


class EventOverlap:
    """Waiting runs the deferred completion (the stand-in's 'kernel finished')."""

    def __init__(self, on_wait: Callable[[], None] | None = None) -> None:
        self._on_wait = on_wait

    def current_stream_wait(self) -> None:
        if self._on_wait is not None:
            self._on_wait()
            self._on_wait = None

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait()


def _hook(fill: Callable[[], None]) -> Callable[[], None]:
    called = []

    def hook() -> None:
        assert not called, "receive hook called twice"
        called.append(True)
        fill()

    return hook


class Buffer:
    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        assert num_nvl_bytes > 0 or num_rdma_bytes > 0
        self._ll_dirty = False  # a normal kernel ran since the last clean
        self.calls: list[str] = []  # for tests: which entry points ran, in order

    # -- config helpers ----------------------------------------------------------------------
    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in _SUPPORTED_RANKS, f"unsupported number of EP ranks {num_ranks}"
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in _SUPPORTED_RANKS, f"unsupported number of EP ranks {num_ranks}"
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return 2 * num_max_dispatch_tokens_per_rank * hidden * 2 * num_experts

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    def _exchange(self, per_dest: list[Any]) -> list[Any]:
        """per_dest[d] goes to rank d; returns what each source rank sent to this rank."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, per_dest, group=self.group)
        return [gathered[src][self.rank] for src in range(self.world)]

    @staticmethod
    def _complete(fill: Callable[[], None], async_finish: bool) -> EventOverlap:
        if async_finish:
            return EventOverlap(fill)
        fill()
        return EventOverlap()

    # -- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        assert topk_idx.dtype == topk_idx_t and topk_idx.dim() == 2
        assert not allocate_on_comm_stream or previous_event is not None
        self.calls.append("get_dispatch_layout")
        e_local = num_experts // self.world
        t = topk_idx.shape[0]
        valid = topk_idx >= 0
        in_rank = torch.zeros(t, self.world, dtype=torch.bool)
        for r in range(self.world):
            in_rank[:, r] = ((topk_idx // e_local == r) & valid).any(1)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: Any = None,
                 num_tokens_per_rdma_rank: Any = None, is_token_in_rank: Any = None,
                 num_tokens_per_expert: Any = None, topk_idx: Any = None, topk_weights: Any = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Any = None,
                 previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:
        assert handle is None, "cached re-dispatch is not used by the adapter"
        assert not allocate_on_comm_stream or previous_event is not None
        self.calls.append("dispatch")
        self._ll_dirty = True
        xs, scales = x if isinstance(x, tuple) else (x, None)
        assert xs.dtype in (torch.bfloat16, torch.float8_e4m3fn)
        if scales is not None:
            assert xs.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
            assert scales.shape == (xs.shape[0], xs.shape[1] // 128)
        else:
            assert xs.dtype == torch.bfloat16
        assert topk_weights.dtype == torch.float32 and topk_idx.dtype == topk_idx_t
        num_experts = num_tokens_per_expert.shape[0]
        e_local = num_experts // self.world
        t, hidden = xs.shape
        per_dest = []
        for d in range(self.world):
            tok = is_token_in_rank[:, d].nonzero().flatten()
            local = topk_idx[tok] - d * e_local
            mine = (topk_idx[tok] >= 0) & (local >= 0) & (local < e_local)
            per_dest.append(dict(
                x=xs[tok].view(torch.uint8) if scales is not None else xs[tok],
                scales=None if scales is None else scales[tok],
                idx=torch.where(mine, local, -1), w=torch.where(mine, topk_weights[tok], 0.0), tok=tok))
        got = self._exchange(per_dest)
        n = sum(g["tok"].numel() for g in got)
        recv_x = torch.full((n, hidden), float("nan"), dtype=torch.bfloat16).to(xs.dtype)
        recv_s = None if scales is None else torch.full((n, hidden // 128), float("nan"))
        recv_idx = torch.cat([g["idx"] for g in got])
        recv_w = torch.cat([g["w"] for g in got])
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=e_local)
        counts = ((counts + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
        src_rank = torch.cat([torch.full((g["tok"].numel(),), r) for r, g in enumerate(got)])
        src_tok = torch.cat([g["tok"] for g in got])

        def fill() -> None:
            if scales is None:
                recv_x.copy_(torch.cat([g["x"] for g in got]))
            else:
                recv_x.view(torch.uint8).copy_(torch.cat([g["x"] for g in got]))
                recv_s.copy_(torch.cat([g["scales"] for g in got]))

        event = self._complete(fill, async_finish)
        # Intranode handle shape: (rank_prefix_matrix, channel_prefix_matrix,
        # recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head); the stand-in
        # keeps the source rank of each received row in the second slot.
        new_handle = (None, src_rank, None, src_tok, is_token_in_rank, None)
        out_x = recv_x if scales is None else (recv_x, recv_s)
        return out_x, recv_idx, recv_w, counts, new_handle, event

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Any = None, bias: Any = None,
                config: Any = None, previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        assert x.dtype == torch.bfloat16 and x.dim() == 2
        assert not allocate_on_comm_stream or previous_event is not None
        self.calls.append("combine")
        self._ll_dirty = True
        _, src_rank, _, src_tok, in_rank, _ = handle
        assert x.shape[0] == src_tok.numel()
        per_dest = [dict(tok=src_tok[src_rank == d], rows=x[src_rank == d]) for d in range(self.world)]
        got = self._exchange(per_dest)
        combined = torch.full((in_rank.shape[0], x.shape[1]), float("nan"), dtype=torch.bfloat16)

        def fill() -> None:
            acc = torch.zeros(combined.shape, dtype=torch.float32)
            for g in got:
                acc.index_add_(0, g["tok"], g["rows"].float())
            combined.copy_(acc)

        return combined, None, self._complete(fill, async_finish)

    # -- low-latency mode ----------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        self.calls.append("clean_low_latency_buffer")
        self._ll_dirty = False

    def _check_ll(self, hidden: int, async_finish: bool, return_recv_hook: bool) -> None:
        assert self.low_latency_mode, "Buffer was not created with low_latency_mode=True"
        assert not self._ll_dirty, "clean_low_latency_buffer must run after normal-mode kernels"
        assert hidden in _LL_HIDDEN, f"hidden {hidden} not supported by low-latency kernels"
        assert not (async_finish and return_recv_hook)

    def _finish_ll(self, fill: Callable[[], None], async_finish: bool,
                   return_recv_hook: bool) -> tuple[EventOverlap, Callable[[], None] | None]:
        if return_recv_hook:
            return EventOverlap(), _hook(fill)
        return self._complete(fill, async_finish), None

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None,
                             dispatch_wait_recv_cost_stats: Any = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> tuple:
        t, hidden = x.shape
        self._check_ll(hidden, async_finish, return_recv_hook)
        assert x.dtype == torch.bfloat16 and topk_idx.dtype == topk_idx_t
        assert topk_idx.shape[1] <= 11 and t <= num_max_dispatch_tokens_per_rank
        assert not use_fp8 or hidden % 512 == 0
        self.calls.append("low_latency_dispatch")
        e_local = num_experts // self.world
        cap = self.world * num_max_dispatch_tokens_per_rank
        assert cap % 4 == 0
        payload, scales = _quant_1x128(x) if use_fp8 else (x, None)
        per_dest = []
        for d in range(self.world):
            tok, slot = ((topk_idx >= d * e_local) & (topk_idx < (d + 1) * e_local)).nonzero(as_tuple=True)
            per_dest.append(dict(
                tok=tok, expert=topk_idx[tok, slot] - d * e_local,
                x=payload[tok].view(torch.uint8) if use_fp8 else payload[tok],
                scales=None if scales is None else scales[tok]))
        got = self._exchange(per_dest)
        recv_count = torch.zeros(e_local, dtype=torch.int32)
        recv = torch.full((e_local, cap, hidden), float("nan"), dtype=torch.bfloat16)
        recv = recv.to(torch.float8_e4m3fn) if use_fp8 else recv
        # Scales are allocated [E, hidden/128, cap] and transposed: MN-major, as DeepEP does.
        recv_s = torch.full((e_local, hidden // 128, cap), float("nan")).transpose(1, 2) if use_fp8 else None
        src_info = torch.full((e_local, cap), -1, dtype=torch.int32)
        layout_range = torch.zeros(e_local, self.world, dtype=torch.int64)
        placement = []  # (expert, row, src rank, index into that source's message)
        for e in range(e_local):
            row = 0
            for r, g in enumerate(got):
                sel = (g["expert"] == e).nonzero().flatten()
                layout_range[e, r] = (row << 32) | sel.numel()
                src_info[e, row:row + sel.numel()] = g["tok"][sel].int()
                placement.append((e, row, r, sel))
                row += sel.numel()
            recv_count[e] = row

        def fill() -> None:
            for e, row, r, sel in placement:
                g, n = got[r], sel.numel()
                if use_fp8:
                    recv[e, row:row + n].view(torch.uint8).copy_(g["x"][sel])
                    recv_s[e, row:row + n] = g["scales"][sel]
                else:
                    recv[e, row:row + n] = g["x"][sel]

        event, hook = self._finish_ll(fill, async_finish, return_recv_hook)
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        out = (recv, recv_s) if use_fp8 else recv
        return out, recv_count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Any = None, combine_wait_recv_cost_stats: Any = None) -> tuple:
        src_info, layout_range, num_max, hidden, num_experts = handle
        self._check_ll(hidden, async_finish, return_recv_hook)
        e_local = num_experts // self.world
        assert x.dtype == torch.bfloat16 and x.shape == (e_local, self.world * num_max, hidden)
        assert topk_weights.dtype == torch.float32 and topk_idx.dtype == topk_idx_t
        self.calls.append("low_latency_combine")
        per_dest: list[dict[str, list[torch.Tensor]]] = [dict(expert=[], tok=[], rows=[]) for _ in range(self.world)]
        for e in range(e_local):
            for r in range(self.world):
                begin, n = int(layout_range[e, r]) >> 32, int(layout_range[e, r]) & 0xFFFFFFFF
                per_dest[r]["expert"].append(torch.full((n,), self.rank * e_local + e))
                per_dest[r]["tok"].append(src_info[e, begin:begin + n].long())
                per_dest[r]["rows"].append(x[e, begin:begin + n])
        got = self._exchange([{k: torch.cat(v) for k, v in d.items()} for d in per_dest])
        t = topk_idx.shape[0]
        combined = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16)

        def fill() -> None:
            acc = torch.zeros(t, hidden)
            for g in got:
                for expert, tok, row in zip(g["expert"].tolist(), g["tok"].tolist(), g["rows"], strict=True):
                    slot = (topk_idx[tok] == expert).nonzero().flatten()
                    acc[tok] += topk_weights[tok, slot].sum() * row.float()
            combined.copy_(acc)

        event, hook = self._finish_ll(fill, async_finish, return_recv_hook)
        return combined, event, hook


class SboBuffer(Buffer):
    """The antgroup-opt branch's Buffer ("LL-SBO"): `low_latency_combine` can take the down GEMM's
    completion signal. Holds the caller to that contract: an int32 counter per (local expert,
    block_m rows of the masked layout), `packed_recv_count` as the dispatch returned it, and every
    block holding received rows signalled `threshold` times before the combine reads it (on the
    CPU the GEMM has run by the time the combine is called, so a counter short of `threshold`
    means the engine and the GEMM disagree on the indexing)."""

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, overlap: bool = False, packed_recv_count: torch.Tensor | None = None,
                            comp_signal: torch.Tensor | None = None, block_m: int = 64, threshold: int = 0,
                            num_sms: int = 3, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Any = None, combine_wait_recv_cost_stats: Any = None) -> tuple:
        if overlap:
            _, layout_range, _, _, num_experts = handle
            e_local, m_max = x.shape[0], x.shape[1]
            counts = (layout_range & 0xFFFFFFFF).sum(1)
            assert packed_recv_count is not None and packed_recv_count.dtype == torch.int32
            assert packed_recv_count.tolist() == counts.tolist(), "packed_recv_count is not the dispatch's"
            assert comp_signal is not None and comp_signal.dtype == torch.int32 and comp_signal.is_contiguous()
            assert block_m > 0 and threshold > 0 and num_sms > 0
            blocks = -(-m_max // block_m)
            assert comp_signal.numel() >= e_local * blocks, "signal too small for the masked layout"
            for e, n in enumerate(counts.tolist()):
                for i in range(-(-n // block_m)):
                    assert int(comp_signal[e * blocks + i]) == threshold, f"expert {e} block {i} not signalled done"
            self.calls.append("low_latency_combine[signal]")
        return super().low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt=use_logfmt,
                                           zero_copy=zero_copy, async_finish=async_finish,
                                           return_recv_hook=return_recv_hook, out=out,
                                           combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)


def make_module(sbo: bool = False):  # noqa: ANN201
    """This module as `deep_ep`, with `Buffer` the antgroup-opt one when `sbo`."""
    import sys
    import types

    mod = types.ModuleType("deep_ep")
    mod.__dict__.update({k: v for k, v in vars(sys.modules[__name__]).items() if not k.startswith("__")})
    mod.Buffer = SboBuffer if sbo else Buffer
    return mod
