"""The kernel bench's shapes and pools (``Setup``), and the references its kernels are
checked and timed against: gathered K/V, the eager reconstruct path, SDPA, the copy rate."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.kernelbench.timing import bench
from forkserve.kernels import reference
from forkserve.kernels.rope import apply_rope, default_inv_freq


class Setup:
    """Shapes and one shared set of pools, sized for the largest case: Llama-3-8B's attention
    (32 query heads over 8 KV heads of 128) and rank-16 residuals unless ``group`` (query
    heads a KV head) or ``rank`` say otherwise; ``max_tokens`` sizes the pools for fewer
    tokens (a process that only builds the kernels: strides and alignment are the same, so
    are the kernels' specializations)."""

    def __init__(self, smoke: bool, group: int | None = None, rank: int | None = None,
                 max_tokens: int | None = None) -> None:
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        if smoke:
            self.n_heads, self.n_kv, self.head_dim, self.rank = 4, 2, 32, 16
            self.contexts, self.batches = [64, 128], [1, 2]
            self.prefill_contexts, self.agents, self.suffix = [64], 4, 16
            self.mixed_contexts, self.mixed_chunk, self.mixed_rows = [64], 16, [2, 3]
            self.cascade_prefixes, self.cascade_members, self.cascade_new = [64], [2, 3], [4, 8]
            self.short_keys, self.short_widths, self.short_batches = [16, 40], [0, 256], [1, 3]
            self.split_prefixes, self.split_agents, self.split_suffix = [64], [2, 4], 24
            self.max_tokens = 1024
        else:
            self.n_heads, self.n_kv, self.head_dim, self.rank = 32, 8, 128, 16
            self.contexts = [1024, 2048, 4096, 8192, 16384, 32768]
            self.batches = [1, 8, 32, 64]
            self.prefill_contexts = [1024, 4096, 8192, 32768]
            self.agents, self.suffix = 32, 128
            # A mixed tick (docs/MULTILORA.md "Round 4"): a ~200-token chunk beside decode rows.
            self.mixed_contexts, self.mixed_chunk, self.mixed_rows = [8192, 32768], 202, [8, 28]
            # --cascade-prefill: agents each prefilling a chunk over one shared context.
            self.cascade_prefixes, self.cascade_members = [8192, 32768], [8, 32]
            self.cascade_new = [32, 128, 512]
            # --decode-short: keys per sequence, table widths (0: the keys'), batches.
            self.short_keys, self.short_widths = [512, 1024, 2048, 4096], [0, 8192, 32768]
            self.short_batches = [1, 8, 64]
            # --cascade-split: shared prefixes, agents per prefix, private suffix (react-like).
            self.split_prefixes, self.split_agents, self.split_suffix = [8192, 32768], [8, 32], 600
            self.max_tokens = 64 * 32768 + 32 * 256
        self.n_heads = self.n_kv * (group or self.n_heads // self.n_kv)
        self.rank = rank or self.rank
        self.max_tokens = max_tokens or self.max_tokens
        self.page = 16
        self.n_adapters = 4
        gen = torch.Generator(device=self.device).manual_seed(0)
        n_pages = self.max_tokens // self.page + 1
        kv_shape = (n_pages, self.page, self.n_kv, self.head_dim)
        # Random data, never zeros: zeros can run faster than real data.
        self.k = torch.randn(kv_shape, generator=gen, device=self.device, dtype=self.dtype)
        self.v = torch.randn(kv_shape, generator=gen, device=self.device, dtype=self.dtype)
        res_shape = (n_pages, self.page, self.rank)
        self.k_res = torch.randn(res_shape, generator=gen, device=self.device, dtype=self.dtype)
        self.v_res = torch.randn(res_shape, generator=gen, device=self.device, dtype=self.dtype)
        b_shape = (self.n_adapters, self.rank, self.n_kv * self.head_dim)
        self.b_k = (torch.randn(b_shape, generator=gen, device=self.device) * 0.1).to(self.dtype)
        self.b_v = (torch.randn(b_shape, generator=gen, device=self.device) * 0.1).to(self.dtype)
        self.inv_freq = default_inv_freq(self.head_dim, base=500000.0, device=self.device)
        self.perm = torch.randperm(n_pages - 1, generator=gen, device=self.device).to(torch.int32)
        self.gen = gen

    def tables(self, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shuffled block tables (base and residual) and seq_lens for ``batch`` x ``ctx``."""
        per = -(-ctx // self.page)
        assert batch * per <= self.perm.numel(), "pool too small for this case"
        bt = self.perm[: batch * per].view(batch, per).contiguous()
        rbt = torch.roll(self.perm, 7)[: batch * per].view(batch, per).contiguous()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=self.device)
        return bt, rbt, lens

    def adapters(self, batch: int) -> torch.Tensor:
        return (torch.arange(batch, device=self.device) % self.n_adapters).to(torch.int32)

    def q(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.n_heads, self.head_dim, generator=self.gen,
                           device=self.device, dtype=self.dtype)


def copy_bandwidth(s: Setup) -> float:
    """Bytes/s of a device-to-device copy of 4 GiB of float32 (read + write counted)."""
    n = (4 << 30) // 4 if not s.smoke else 1 << 20
    x = torch.randn(n, device=s.device, dtype=torch.float32)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), s.smoke)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def gathered_kv(s: Setup, bt: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``[batch, Hkv, ctx, D]`` copies of the paged K/V (for SDPA)."""
    k = reference.gather_pages(s.k, bt, ctx).transpose(1, 2).contiguous()
    v = reference.gather_pages(s.v, bt, ctx).transpose(1, 2).contiguous()
    return k, v


def eager_reconstruct(s: Setup, bt: torch.Tensor, rbt: torch.Tensor, ctx: int,
                      adapters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager disaggregated path: gather, up-project, RoPE, add. ``[batch, Hkv, ctx, D]``."""
    kb = reference.gather_pages(s.k, bt, ctx)
    vb = reference.gather_pages(s.v, bt, ctx)
    kr = reference.gather_pages(s.k_res, rbt, ctx)
    vr = reference.gather_pages(s.v_res, rbt, ctx)
    dk = torch.bmm(kr, s.b_k[adapters.long()]).unflatten(-1, (s.n_kv, s.head_dim))
    dv = torch.bmm(vr, s.b_v[adapters.long()]).unflatten(-1, (s.n_kv, s.head_dim))
    pos = torch.arange(ctx, device=s.device)
    k = kb + apply_rope(dk, pos, s.inv_freq).to(s.dtype)
    v = vb + dv
    return k.transpose(1, 2), v.transpose(1, 2)


def sdpa_decode(s: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """GQA decode through SDPA: the group's query heads become query rows of their KV head."""
    batch = q.shape[0]
    qg = q.view(batch, s.n_kv, s.n_heads // s.n_kv, s.head_dim)
    return F.scaled_dot_product_attention(qg, k, v).reshape(batch, s.n_heads, s.head_dim)


def sdpa_prefill(s: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = s.n_heads // s.n_kv
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def sdpa_backend(s: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 backend) -> torch.Tensor:
    """Torch SDPA on contiguous ``[1, Hkv, L, D]`` K/V, GQA native, one backend or (None) torch's
    own pick; a cold prefill (square causal)."""
    from torch.nn.attention import sdpa_kernel
    qh = q.transpose(0, 1)[None]
    if backend is None:
        return F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
