"""Query-directed sparse attention in plain PyTorch, O(n·(w + g)) time and memory.

QDS-Transformer (Jiang, Xiong, Lee, Wang; Findings of EMNLP 2020, arXiv 2010.12683, §3) replaces
BERT's full self-attention with the union of four sparse patterns over the input
``[CLS] q₁ … q_m [SEP] [SOS] s₁ … [SOS] s₂ … [SEP]``:

    A_local = {(i, j) : |i − j| ≤ r},  r = w // 2        (Eq. 7)   local window of w tokens
    A_sent  = {(i, j) : t_j is an [SOS] token}           (Eq. 8)   every token sees every sentence start
    A_query = {(i, j) : t_i or t_j is a query token}     (Eq. 9)   query tokens see and are seen by all
    A_[CLS] = {(i, j) : t_i or t_j is [CLS]}             (Eq. 10)  so does [CLS]
    A_QDS   = A_local ∪ A_sent ∪ A_query ∪ A_[CLS]         restricted to non-padding i and j.

``(i, j)`` means "query position i may attend to key position j". Eq. 8 is read as in issue 7: the
[SOS] *keys* are global (every token attends to them); an [SOS] *row* attends to its window plus
the global keys, unless ``sentence_rows_global=True`` makes the [SOS] hierarchy symmetric.

Everything reduces to two per-token roles, which is what this module works with:

* ``key_global[b, j]``  — every token attends to key j        ([CLS], query tokens, [SOS])
* ``row_global[b, i]``  — token i attends to every key         ([CLS], query tokens)

so ``allowed(i, j) = valid_i ∧ valid_j ∧ (|i − j| ≤ r ∨ key_global_j ∨ row_global_i)``.
Patterns: ``"qds"`` (all of the above), ``"longformer-qa"`` (local + [CLS]/query global, no [SOS];
the Longformer QA setting), ``"local"`` (window only). A row with no allowed key (padding) outputs 0.

How it is computed without an n×n matrix (``qds_attention``):

1. **Band.** The sequence is cut into nb blocks of b tokens (default b = r). Block c's queries see
   the keys of blocks c−h … c+h (h = ⌈r / b⌉), i.e. 2h+1 batched ``[b, d] × [d, b]`` matmuls over all
   blocks at once. Positions outside |i − j| ≤ r, padding, and global keys (counted in step 2) are
   masked.
2. **Global keys.** The key_global positions of each batch item are gathered (padded to the largest
   count g) and every query scores them: ``[n, d] × [d, g]``.
3. **One softmax** per row over its band scores and its global-key scores together (shared row max
   and normaliser). A key both in the window and global is only in the global part: no double count.
4. **Global rows.** row_global queries are gathered and attend densely to all n keys
   (``[g_r, d] × [d, n]``, key padding masked); their outputs overwrite the band result.

Cost: n·((2h+1)·b + g) + g_r·n scores, i.e. O(n·(w + g)) time. Memory is O(n·d) plus one chunk
of scores: steps 1–3 are a ``torch.autograd.Function`` that walks the query blocks in chunks, keeps
only q, k, v, the output and per-row softmax statistics, and recomputes a chunk's scores in the
backward pass (the FlashAttention recipe, here with batched matmuls instead of a fused kernel);
step 4 is small and uses autograd. The pattern-dependent bookkeeping (indices, masks) is a
``SparseLayout`` built once per batch and shared by every layer and head. ``dense_mask`` builds
the equivalent [B, n, n] boolean mask, for tests and the "dense + QDS mask" baseline of
``bench/qds_attention.py``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ckray.errors import ConfigError

PATTERNS = ("qds", "longformer-qa", "local")
# Score entries alive at once in qds_attention (band + global keys, all heads of a chunk of query
# blocks). CPU: 2^22 (16 MiB fp32) — smaller chunks stay in cache but add per-op thread
# synchronisation, which hurts on a loaded machine; GPUs: large chunks, few kernel launches.
# Chunks are never fewer than 1/MAX_CHUNKS of the sequence, which bounds the number of kernels.
CHUNK_SCORES = {"cpu": 1 << 22, "cuda": 1 << 26}
MAX_CHUNKS = 8


# ---------------------------------------------------------------------------------------------
# Pattern → per-token roles
# ---------------------------------------------------------------------------------------------

def pattern_roles(
    attention_mask: torch.Tensor,
    global_mask: torch.Tensor | None = None,
    sentence_mask: torch.Tensor | None = None,
    pattern: str = "qds",
    sentence_rows_global: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map token kinds to ``(valid, key_global, row_global)``, each ``[B, n]`` bool.

    ``attention_mask``: 1/True for real tokens, 0/False for padding. ``global_mask``: [CLS] and query
    tokens (Eq. 9–10). ``sentence_mask``: [SOS] tokens (Eq. 8). Both default to "none".
    """
    if pattern not in PATTERNS:
        raise ConfigError(f"attention pattern must be one of {PATTERNS}, got {pattern!r}")
    valid = attention_mask.bool()
    none = torch.zeros_like(valid)
    glob = global_mask.bool() & valid if global_mask is not None else none
    sent = sentence_mask.bool() & valid if sentence_mask is not None else none
    if pattern == "local":
        return valid, none, none
    if pattern == "longformer-qa":
        return valid, glob, glob
    row_global = glob | sent if sentence_rows_global else glob
    return valid, glob | sent, row_global


def dense_mask(
    attention_mask: torch.Tensor,
    window: int,
    global_mask: torch.Tensor | None = None,
    sentence_mask: torch.Tensor | None = None,
    pattern: str = "qds",
    sentence_rows_global: bool = False,
) -> torch.Tensor:
    """The [B, n, n] boolean mask (True = may attend) of the same pattern, materialised.

    Only for tests, small inputs and the masked-dense baseline; the sparse path never builds it.
    """
    valid, key_global, row_global = pattern_roles(attention_mask, global_mask, sentence_mask,
                                                  pattern, sentence_rows_global)
    n, r = valid.shape[1], window // 2
    local = torch.ones(n, n, dtype=torch.bool, device=valid.device).triu_(-r).tril_(r)
    allowed = local[None] | key_global[:, None, :] | row_global[:, :, None]
    return allowed & valid[:, :, None] & valid[:, None, :]


# ---------------------------------------------------------------------------------------------
# Layout: everything that depends on the pattern but not on q, k, v
# ---------------------------------------------------------------------------------------------

@dataclass
class SparseLayout:
    """Indices and masks of one batch's sparse pattern (built by ``build_layout``).

    Shapes: B batch, n tokens, b block, nb = ⌈n / b⌉ blocks, T = 2h + 1 key blocks per query
    block, g global keys, g_r global rows. Band tensors are *block-major* ([T, nb, B, H, b, b]) so
    that each shift t is one contiguous batched matmul.
    """

    n: int
    radius: int                # r: |i − j| ≤ r is local
    block: int                 # b: tokens per block
    halo: int                  # h: neighbouring blocks on each side
    num_blocks: int            # nb
    valid: torch.Tensor        # [B, n] bool
    band_masked: torch.Tensor  # [T, nb, B, 1, b, b] bool, True = masked (outside window, padding, global key)
    key_index: torch.Tensor    # [B, g] long: key_global positions, padded with 0
    key_masked: torch.Tensor | None  # [B, 1, 1, g] bool, True = padding slot; None if there is none
    row_index: torch.Tensor    # [B, g_r] long: row_global positions, padded with 0
    row_select: tuple[torch.Tensor, ...]  # real slots of row_index: (batch, slot, position), [R] each

    @property
    def num_global_keys(self) -> int:
        return int(self.key_index.shape[1])

    @property
    def num_global_rows(self) -> int:
        return int(self.row_index.shape[1])

    def to(self, device: torch.device | str) -> "SparseLayout":
        def move(v):
            if isinstance(v, tuple):
                return tuple(move(x) for x in v)
            return v.to(device) if isinstance(v, torch.Tensor) else v
        return SparseLayout(**{k: move(v) for k, v in vars(self).items()})


def _packed_positions(flags: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the True entries of each row of ``flags`` [B, n], left-packed in order and
    padded with ``fill`` to the largest count: ``(index [B, g], keep [B, g])``."""
    counts = flags.sum(dim=1)
    g = int(counts.max()) if flags.numel() else 0
    # A stable sort of "not flag" puts the flagged positions first, in positional order.
    order = torch.sort((~flags).to(torch.uint8), dim=1, stable=True).indices[:, :g]
    keep = torch.arange(g, device=flags.device)[None, :] < counts[:, None]
    return order.masked_fill(~keep, fill), keep


def build_layout(
    attention_mask: torch.Tensor,
    window: int,
    global_mask: torch.Tensor | None = None,
    sentence_mask: torch.Tensor | None = None,
    pattern: str = "qds",
    sentence_rows_global: bool = False,
    block_size: int | None = None,
) -> SparseLayout:
    """Precompute the sparse pattern of a batch (see the module docstring for the pattern).

    ``window`` is w, the local span: token i sees j when |i − j| ≤ w // 2 (w + 1 tokens for even w).
    ``block_size`` (default r = w // 2, at most n) trades wasted band scores, (2h+1)·b − (2r+1)
    per row, against the number of small matmuls.
    """
    if window < 0:
        raise ConfigError(f"attention window must be >= 0, got {window}")
    valid, key_global, row_global = pattern_roles(attention_mask, global_mask, sentence_mask,
                                                  pattern, sentence_rows_global)
    bsz, n = valid.shape
    radius = min(window // 2, max(n - 1, 0))       # a window wider than the sequence changes nothing
    block = max(1, min(block_size or radius or 1, n))
    halo = math.ceil(radius / block)
    nb = math.ceil(n / block)
    shifts = 2 * halo + 1

    # Query block c, slot i is position c·b + i; its key block t (0 … 2h), slot j is (c − h + t)·b + j.
    slot = torch.arange(block, device=valid.device)
    offset = (torch.arange(shifts, device=valid.device) - halo) * block
    in_window = (offset[:, None, None] + slot[None, None, :] - slot[None, :, None]).abs() <= radius
    key_ok = F.pad((valid & ~key_global).to(torch.uint8), (halo * block, (nb + halo) * block - n))
    key_ok = key_ok.view(bsz, nb + 2 * halo, block).bool()
    key_ok = torch.stack([key_ok[:, t:t + nb] for t in range(shifts)])             # [T, B, nb, b]
    allowed = in_window[:, None, None] & key_ok.transpose(1, 2)[:, :, :, None, :]  # [T, nb, B, b, b]

    key_index, key_keep = _packed_positions(key_global, fill=0)
    row_index, row_keep = _packed_positions(row_global, fill=0)
    row_batch, row_slot = row_keep.nonzero(as_tuple=True)
    return SparseLayout(
        n=n, radius=radius, block=block, halo=halo, num_blocks=nb, valid=valid,
        band_masked=~allowed[:, :, :, None], key_index=key_index,
        key_masked=None if bool(key_keep.all()) else ~key_keep[:, None, None, :], row_index=row_index,
        row_select=(row_batch, row_slot, row_index[row_batch, row_slot]),
    )


# ---------------------------------------------------------------------------------------------
# The attention
# ---------------------------------------------------------------------------------------------

def _copy(dst: torch.Tensor, src: torch.Tensor, scale: float | None) -> None:
    """``dst ← src`` (times ``scale`` if given), one pass, any strides."""
    if scale is None:
        dst.copy_(src)
    else:
        torch.mul(src, scale, out=dst)


def _to_blocks(x: torch.Tensor, block: int, num_blocks: int, left: int = 0,
               scale: float | None = None) -> torch.Tensor:
    """``[B, H, n, d]`` → block-major ``[num_blocks, B, H, b, d]`` (contiguous, one copy, times
    ``scale`` if given), with ``left`` zero blocks before position 0 and zeros after position n."""
    bsz, heads, n, dim = x.shape
    out = x.new_empty(num_blocks, bsz, heads, block, dim)
    full, rem = divmod(n, block)
    _copy(out[left: left + full].permute(1, 2, 0, 3, 4), x[:, :, : full * block].unflatten(2, (full, block)), scale)
    if rem:
        _copy(out[left + full, :, :, :rem], x[:, :, full * block:], scale)
        out[left + full, :, :, rem:].zero_()
    out[:left].zero_()
    out[left + full + (rem > 0):].zero_()
    return out


def _to_tokens(x: torch.Tensor, n: int, left: int = 0, scale: float | None = None) -> torch.Tensor:
    """Block-major ``[nb, B, H, b, d]`` → contiguous ``[B, H, n, d]`` (positions from block ``left``)."""
    _, bsz, heads, block, dim = x.shape
    out = x.new_empty(bsz, heads, n, dim)
    full, rem = divmod(n, block)
    _copy(out[:, :, : full * block].unflatten(2, (full, block)), x[left: left + full].permute(1, 2, 0, 3, 4), scale)
    if rem:
        _copy(out[:, :, full * block:], x[left + full, :, :, :rem], scale)
    return out


def _from_blocks(x: torch.Tensor) -> torch.Tensor:
    """Block-major ``[C, B, H, b, *]`` → token-major ``[B, H, C·b, *]`` (a copy)."""
    return x.permute(1, 2, 0, 3, 4).flatten(2, 3)


def _blocks_view(x: torch.Tensor, num_blocks: int, block: int) -> torch.Tensor:
    """Token-major ``[B, H, C·b, *]`` → block-major view ``[C, B, H, b, *]`` (no copy)."""
    return x.unflatten(2, (num_blocks, block)).permute(2, 0, 1, 3, 4)


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, acc: bool = False) -> torch.Tensor:
    """Batched matmul over all leading dims of block-major tensors (their leading dims must merge:
    slices along the block axis do), into ``out`` (added to it when ``acc``)."""
    a3, b3 = a.flatten(0, -3), b.flatten(0, -3)
    if out is None:
        return torch.bmm(a3, b3).unflatten(0, a.shape[:-2])
    o3 = out.view(-1, *out.shape[-2:])
    if acc:
        o3.baddbmm_(a3, b3)
    else:
        torch.bmm(a3, b3, out=o3)
    return out


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replayed_rng(state: tuple | None, device: torch.device):
    """Re-run a block of random draws exactly as in the forward pass (dropout masks are not saved)."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _chunk_exp_scores(q_c, k_b, k_glob, band_masked, key_masked, c0: int, row_max=None):
    """E = exp(S − m) for query blocks ``c0 : c0 + C`` (``q_c`` block-major ``[C, B, H, b, d]``).

    Returns ``e_band [T, C, B, H, b, b]`` (key block t of query block c is block c − h + t),
    ``e_glob [B, H, C·b, g]``, the chunk's queries token-major ``[B, H, C·b, d]`` and the row max
    ``m [C, B, H, b]`` (computed here unless given: the backward pass reuses the forward's).
    Masked entries are −inf, not finfo.min: exp of a huge finite negative takes a ~5× slower path on CPU.
    """
    shifts, chunk, block = band_masked.shape[0], q_c.shape[0], q_c.shape[-2]
    e_band = q_c.new_empty(shifts, *q_c.shape[:-1], block)
    for t in range(shifts):
        _bmm(q_c, k_b[c0 + t: c0 + t + chunk].transpose(-1, -2), out=e_band[t])
    e_band.masked_fill_(band_masked[:, c0: c0 + chunk], float("-inf"))
    q_tok = _from_blocks(q_c)
    e_glob = q_tok @ k_glob.transpose(-1, -2)
    if key_masked is not None:
        e_glob.masked_fill_(key_masked, float("-inf"))
    if row_max is None:
        row_max = e_band.amax(dim=(0, -1))
        if e_glob.shape[-1]:
            glob_max = _blocks_view(e_glob.amax(dim=-1, keepdim=True), chunk, block)[..., 0]
            row_max = torch.maximum(row_max, glob_max)
        row_max.clamp_(min=torch.finfo(q_c.dtype).min)  # a row with no allowed key: exp(−inf − m) = 0
    e_band.sub_(row_max[None, ..., None]).exp_()
    e_glob.sub_(_from_blocks(row_max[..., None])).exp_()
    return e_band, e_glob, q_tok, row_max


def _dropout_masks(e_band: torch.Tensor, e_glob: torch.Tensor, p: float):
    if p <= 0:
        return None, None
    return torch.rand_like(e_band) >= p, torch.rand_like(e_glob) >= p


def _dropped(x: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    return x if keep is None else x * keep * (1.0 / (1.0 - p))


class _BandGlobalAttention(torch.autograd.Function):
    """Steps 1–3 of the module docstring, FlashAttention-style: chunked, recomputed in backward.

    Query blocks are processed ``chunk`` blocks at a time, so score tensors exist for one chunk
    only. The forward keeps just O(n·d) state — q (scaled), k, v in block layout, the output O, the
    row max m and normaliser l — and the backward recomputes each chunk's E = exp(S − m) (P = E / l)
    and uses the identity rowsum(P ∘ dP) = rowsum(dO ∘ O) with dO' = dO / l:

        dV = Eᵀ·dO',   dS = E ∘ (dO'·Vᵀ − rowsum(dO' ∘ O)),   dQ = scale·dS·K,   dK = dSᵀ·(scale·Q).

    Dropout masks are not stored either: the backward replays the forward's random draws.
    Autograd over the same ops would keep every score and probability tensor alive and add several
    elementwise passes (concatenation, slicing and their folds), which dominates on CPU.
    Inputs ``q``, ``k``, ``v``: ``[B, H, n, d]``; output ``[B, H, n, d]`` with padding rows 0.
    """

    @staticmethod
    def forward(ctx, q, k, v, valid, band_masked, key_index, key_masked, block: int, halo: int,
                scale: float, dropout_p: float, chunk: int):
        bsz, heads, n, dim = q.shape
        shifts, nb = band_masked.shape[0], band_masked.shape[1]
        q_b = _to_blocks(q, block, nb, scale=scale)
        k_b = _to_blocks(k, block, nb + 2 * halo, left=halo)
        v_b = _to_blocks(v, block, nb + 2 * halo, left=halo)
        index = key_index[:, None, :, None].expand(bsz, heads, -1, dim)
        k_glob, v_glob = k.gather(2, index), v.gather(2, index)

        out_b = torch.empty_like(q_b)
        row_max = q.new_empty(nb, bsz, heads, block)
        denom = torch.empty_like(row_max)
        rng = _rng_state(q.device) if dropout_p > 0 else None
        for c0 in range(0, nb, chunk):
            c1 = min(nb, c0 + chunk)
            e_band, e_glob, _, m = _chunk_exp_scores(q_b[c0:c1], k_b, k_glob, band_masked, key_masked, c0)
            glob_sum = _blocks_view(e_glob.sum(dim=-1, keepdim=True), c1 - c0, block)[..., 0]
            l = (e_band.sum(dim=(0, -1)) + glob_sum).clamp_(min=torch.finfo(q.dtype).tiny)
            keep_band, keep_glob = _dropout_masks(e_band, e_glob, dropout_p)
            e_band, e_glob = _dropped(e_band, keep_band, dropout_p), _dropped(e_glob, keep_glob, dropout_p)
            o = out_b[c0:c1]
            for t in range(shifts):
                _bmm(e_band[t], v_b[c0 + t: c1 + t], out=o, acc=t > 0)
            o.add_(_blocks_view(e_glob @ v_glob, c1 - c0, block)).div_(l[..., None])
            row_max[c0:c1], denom[c0:c1] = m, l
            del e_band, e_glob

        ctx.save_for_backward(q_b, k_b, v_b, k_glob, v_glob, valid, key_index, band_masked, key_masked,
                              out_b, row_max, denom)
        ctx.shape, ctx.block, ctx.halo, ctx.scale = (n, nb), block, halo, scale
        ctx.dropout_p, ctx.chunk, ctx.rng = dropout_p, chunk, rng
        out = _to_tokens(out_b, n)
        return out.masked_fill_(~valid[:, None, :, None], 0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        (q_b, k_b, v_b, k_glob, v_glob, valid, key_index, band_masked, key_masked,
         out_b, row_max, denom) = ctx.saved_tensors
        (n, nb), block, halo, p, chunk = ctx.shape, ctx.block, ctx.halo, ctx.dropout_p, ctx.chunk
        shifts, bsz, heads, dim = band_masked.shape[0], q_b.shape[1], q_b.shape[2], q_b.shape[-1]

        # dO' = dO / l on real rows; padding rows were zeroed in the forward, so they get no gradient
        valid_b = F.pad(valid, (0, nb * block - n)).view(bsz, nb, block).transpose(0, 1)
        d_out_b = _to_blocks(d_out, block, nb)
        d_out_b.mul_((valid_b[:, :, None, :] / denom)[..., None])
        d_q_b = torch.empty_like(q_b)
        d_k_b, d_v_b = torch.zeros_like(k_b), torch.zeros_like(v_b)
        d_k_glob, d_v_glob = torch.zeros_like(k_glob), torch.zeros_like(v_glob)
        with _replayed_rng(ctx.rng, q_b.device):
            for c0 in range(0, nb, chunk):
                c1 = min(nb, c0 + chunk)
                e_band, e_glob, q_tok, _ = _chunk_exp_scores(q_b[c0:c1], k_b, k_glob, band_masked,
                                                             key_masked, c0, row_max[c0:c1])
                keep_band, keep_glob = _dropout_masks(e_band, e_glob, p)
                d_o = d_out_b[c0:c1]
                d_o_tok = _from_blocks(d_o)
                delta = (d_o * out_b[c0:c1]).sum(dim=-1)                              # rowsum(dO' ∘ O)

                # dV = Eᵀ·dO' (with the dropout mask applied to E)
                for t in range(shifts):
                    e_t = _dropped(e_band[t], None if keep_band is None else keep_band[t], p)
                    _bmm(e_t.transpose(-1, -2), d_o, out=d_v_b[c0 + t: c1 + t], acc=True)
                d_v_glob += _dropped(e_glob, keep_glob, p).transpose(-1, -2) @ d_o_tok

                # dS = E ∘ (dP' − delta), dP' = dO'·Vᵀ (through the dropout mask)
                d_s = torch.empty_like(e_band)
                for t in range(shifts):
                    _bmm(d_o, v_b[c0 + t: c1 + t].transpose(-1, -2), out=d_s[t])
                d_s_glob = d_o_tok @ v_glob.transpose(-1, -2)
                if keep_band is not None:
                    d_s.mul_(keep_band).mul_(1.0 / (1.0 - p))
                    d_s_glob.mul_(keep_glob).mul_(1.0 / (1.0 - p))
                d_s.sub_(delta[None, ..., None]).mul_(e_band)
                d_s_glob.sub_(_from_blocks(delta[..., None])).mul_(e_glob)
                del e_band, e_glob, keep_band, keep_glob

                # dQ = dS·K (scale applied at the end), dK = dSᵀ·(scale·Q)
                d_q = d_q_b[c0:c1]
                for t in range(shifts):
                    _bmm(d_s[t], k_b[c0 + t: c1 + t], out=d_q, acc=t > 0)
                    _bmm(d_s[t].transpose(-1, -2), q_b[c0:c1], out=d_k_b[c0 + t: c1 + t], acc=True)
                d_q.add_(_blocks_view(d_s_glob @ k_glob, c1 - c0, block))
                d_k_glob += d_s_glob.transpose(-1, -2) @ q_tok
                del d_s, d_s_glob

        del d_out_b
        d_q = _to_tokens(d_q_b, n, scale=ctx.scale)
        del d_q_b
        index = key_index[:, None, :, None].expand(bsz, heads, -1, dim)
        d_k = _to_tokens(d_k_b, n, left=halo).scatter_add_(2, index, d_k_glob)   # padded slots: E = 0
        del d_k_b
        d_v = _to_tokens(d_v_b, n, left=halo).scatter_add_(2, index, d_v_glob)
        return d_q, d_k, d_v, None, None, None, None, None, None, None, None, None


def qds_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SparseLayout,
    dropout_p: float = 0.0,
    scale: float | None = None,
    chunk_scores: int | None = None,
) -> torch.Tensor:
    """Sparse softmax(q·kᵀ·scale)·v under ``layout``; ``q, k, v``: ``[B, H, n, d]`` → ``[B, H, n, d]``.

    Equal (up to float rounding) to dense attention under ``dense_mask(...)`` of the same arguments,
    with rows that may attend to nothing (padding) set to 0. ``dropout_p`` drops attention
    probabilities, like BERT's attention dropout (pass 0 in eval). ``chunk_scores`` bounds the
    score entries alive at once (band + global keys, all heads; by default ``CHUNK_SCORES`` of the
    device, relaxed so that there are at most ``MAX_CHUNKS`` chunks); it sets how many query
    blocks are processed together, i.e. peak memory and speed, never the result.
    """
    bsz, heads, n, dim = q.shape
    if n != layout.n:
        raise ValueError(f"layout was built for n={layout.n}, got inputs with n={n}")
    scale = dim ** -0.5 if scale is None else scale
    # Under autocast q, k, v may differ in dtype; compute in q's dtype with autocast off, so the
    # in-place / ``out=`` kernels below see one dtype (bf16 in, bf16 out on GPUs).
    with torch.autocast(device_type=q.device.type, enabled=False):
        k, v = k.to(q.dtype), v.to(q.dtype)

        # 1–3. band + global keys, one softmax, ``chunk`` query blocks at a time
        keys_per_row = (2 * layout.halo + 1) * layout.block + layout.num_global_keys
        per_block = bsz * heads * layout.block * keys_per_row
        if chunk_scores is None:
            budget = CHUNK_SCORES.get(q.device.type, CHUNK_SCORES["cuda"])
            chunk = max(1, budget // per_block, math.ceil(layout.num_blocks / MAX_CHUNKS))
        else:
            chunk = max(1, chunk_scores // per_block)
        out = _BandGlobalAttention.apply(q, k, v, layout.valid, layout.band_masked, layout.key_index,
                                         layout.key_masked, layout.block, layout.halo, scale, dropout_p,
                                         chunk)

        # 4. global rows: dense over all n keys (O(g_r·n), plain autograd), written over the band rows
        if layout.num_global_rows:
            index = layout.row_index[:, None, :, None].expand(bsz, heads, -1, dim)
            row_scores = (q.gather(2, index) * scale) @ k.transpose(-1, -2)           # [B,H,g_r,n]
            # finite fill: a padded slot of an all-padding item must not turn into NaN
            row_scores = row_scores.masked_fill(~layout.valid[:, None, None, :], torch.finfo(q.dtype).min)
            row_probs = torch.softmax(row_scores, dim=-1)
            row_probs = F.dropout(row_probs, p=dropout_p) if dropout_p > 0 else row_probs
            row_out = row_probs @ v                                                   # [B,H,g_r,d]
            batch, slot, position = layout.row_select
            all_heads = torch.arange(heads, device=q.device)[None, :]
            out.index_put_((batch[:, None], all_heads, position[:, None]), row_out[batch, :, slot])
    return out


def fused_masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """What :func:`qds_attention` computes, through torch's fused ``scaled_dot_product_attention``
    under the pattern's materialised ``[B, n, n]`` mask (:func:`dense_mask`): O(n²) memory for the mask,
    one fused kernel instead of dozens per chunk of query blocks. On an H200 in bf16 one layer's forward
    + backward takes 0.45 ms against 5.2 ms at n = 512 and 3.1 against 5.3 ms at 8,192
    (``bench/qds_attention.py``, docs/gpu.md); in a CPU training step it is the faster one without
    attention dropout, the sparse path with it (torch's fused attention leaves its fast path there).
    Rows that may attend to nothing (padding) output 0, as in :func:`qds_attention`.
    """
    empty = ~mask.any(dim=-1)                                   # [B, n]: rows with no key
    allowed = (mask | empty[:, :, None])[:, None]               # such rows see every key (finite), then 0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)
    return out.masked_fill(empty[:, None, :, None], 0.0)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference dense attention under a boolean mask ``[B, n, n]`` (or broadcastable), O(n²).

    Rows without any allowed key output 0 (where ``scaled_dot_product_attention`` gives NaN).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = mask[:, None] if mask.dim() == 3 else mask
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(q.dtype).min), dim=-1)
    probs = probs * mask.any(dim=-1, keepdim=True).to(probs.dtype)
    return probs @ v
