"""Query-directed sparse attention equals dense attention under the same boolean mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ckray.errors import ConfigError
from ckray.models.sparse_attention import (
    PATTERNS,
    build_layout,
    dense_mask,
    masked_attention,
    pattern_roles,
    qds_attention,
)


def random_batch(gen: torch.Generator, bsz: int, n: int) -> dict[str, torch.Tensor]:
    """Items of random length, each ``[CLS] query [SEP] ([SOS] sentence)* pad*`` with random query
    lengths and sentence boundaries."""
    attention = torch.zeros(bsz, n, dtype=torch.bool)
    glob = torch.zeros_like(attention)
    sent = torch.zeros_like(attention)
    for b in range(bsz):
        length = int(torch.randint(1, n + 1, (1,), generator=gen)) if b else n   # item 0 unpadded
        attention[b, :length] = True
        q_len = int(torch.randint(0, max(1, min(8, length - 1)), (1,), generator=gen))
        glob[b, : q_len + 1] = True                                            # [CLS] + query
        pos = q_len + 2
        while pos < length:
            sent[b, pos] = True
            pos += int(torch.randint(1, 12, (1,), generator=gen))
    return {"attention_mask": attention, "global_mask": glob, "sentence_mask": sent}


def qkv(gen: torch.Generator, bsz: int, heads: int, n: int, dim: int, dtype=torch.float32):
    return [torch.randn(bsz, heads, n, dim, generator=gen, dtype=dtype).requires_grad_(True)
            for _ in range(3)]


def grads(out: torch.Tensor, weight: torch.Tensor, inputs) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * weight).sum(), inputs))


# ---------------------------------------------------------------------------------------------
# Exactness: outputs and gradients
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("seed", range(6))
def test_matches_dense_attention_with_same_mask(pattern: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    bsz = int(torch.randint(1, 4, (1,), generator=gen))
    n = int(torch.randint(5, 90, (1,), generator=gen))
    heads, dim = int(torch.randint(1, 4, (1,), generator=gen)), 8
    window = int(torch.randint(0, 40, (1,), generator=gen))
    block = [None, 1, 3, 8, 16][seed % 5]
    chunk_scores = [None, 1, 3000][seed % 3]          # one chunk, one block per chunk, a few blocks
    roles = random_batch(gen, bsz, n)
    q, k, v = qkv(gen, bsz, heads, n, dim)

    layout = build_layout(window=window, pattern=pattern, block_size=block, **roles)
    mask = dense_mask(window=window, pattern=pattern, **roles)
    out = qds_attention(q, k, v, layout, chunk_scores=chunk_scores)
    ref = masked_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

    weight = torch.randn(out.shape, generator=gen)
    for g, g_ref, name in zip(grads(out, weight, (q, k, v)), grads(ref, weight, (q, k, v)), "qkv"):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=0, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("window,n", [(0, 17), (1, 17), (2, 17), (128, 300), (1000, 40), (64, 64)])
def test_window_edge_cases(window: int, n: int):
    """Empty/odd windows, a window wider than the sequence, a sequence that is exactly one block."""
    gen = torch.Generator().manual_seed(window + n)
    roles = random_batch(gen, 2, n)
    q, k, v = qkv(gen, 2, 2, n, 4)
    out = qds_attention(q, k, v, build_layout(window=window, **roles))
    ref = masked_attention(q, k, v, dense_mask(window=window, **roles))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    weight = torch.randn(out.shape, generator=gen)
    for g, g_ref in zip(grads(out, weight, (q, k, v)), grads(ref, weight, (q, k, v))):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=0)


def test_symmetric_sentence_rows_and_real_layout():
    """``sentence_rows_global``: [SOS] rows see everything too; a 2,000-token layout with the
    bench's pattern (query 20, [SOS] every 25) still equals the dense computation."""
    gen = torch.Generator().manual_seed(7)
    n = 2000
    attention = torch.ones(1, n, dtype=torch.bool)
    glob = torch.zeros_like(attention)
    glob[:, :21] = True
    sent = torch.zeros_like(attention)
    sent[:, 22::25] = True
    roles = {"attention_mask": attention, "global_mask": glob, "sentence_mask": sent}
    q, k, v = qkv(gen, 1, 2, n, 16)
    for symmetric in (False, True):
        layout = build_layout(window=128, sentence_rows_global=symmetric, **roles)
        mask = dense_mask(window=128, sentence_rows_global=symmetric, **roles)
        out = qds_attention(q, k, v, layout)
        torch.testing.assert_close(out, masked_attention(q, k, v, mask), atol=1e-5, rtol=0)
        # also against PyTorch's own masked SDPA (no padding rows here, so no NaN rows)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_scores", [None, 1])
def test_float64_gradcheck_including_dropout(chunk_scores):
    """The hand-written backward (band, global keys, dropout replayed chunk by chunk) against
    finite differences."""
    gen = torch.Generator().manual_seed(3)
    roles = random_batch(gen, 2, 13)
    q, k, v = qkv(gen, 2, 2, 13, 3, dtype=torch.float64)
    layout = build_layout(window=4, block_size=2, **roles)

    def attention(q, k, v, p):
        torch.manual_seed(0)     # the same dropout mask on every call
        return qds_attention(q, k, v, layout, dropout_p=p, chunk_scores=chunk_scores)

    for p in (0.0, 0.3):
        assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, p), (q, k, v), fast_mode=True)


def test_chunking_changes_nothing_but_memory():
    gen = torch.Generator().manual_seed(11)
    roles = random_batch(gen, 2, 200)
    q, k, v = qkv(gen, 2, 3, 200, 8)
    layout = build_layout(window=24, **roles)
    weight = torch.randn(2, 3, 200, 8, generator=gen)
    results = []
    for chunk_scores in (None, 1, 5000):
        out = qds_attention(q, k, v, layout, chunk_scores=chunk_scores)
        results.append([out, *grads(out, weight, (q, k, v))])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_all_padding_item_and_empty_rows_stay_finite():
    """An item that is only padding, and local-only rows whose window holds no real key."""
    attention = torch.zeros(3, 40, dtype=torch.bool)
    attention[0, :40] = True
    attention[2, :3] = True
    glob = torch.zeros_like(attention)
    glob[0, :4] = True
    gen = torch.Generator().manual_seed(2)
    for pattern in PATTERNS:
        q, k, v = qkv(gen, 3, 2, 40, 4)
        out = qds_attention(q, k, v, build_layout(attention, 4, glob, pattern=pattern), dropout_p=0.1)
        out.sum().backward()
        assert torch.isfinite(out).all() and out[1].eq(0).all() and out[2, :, 3:].eq(0).all()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_dropout_is_unbiased_and_off_at_zero():
    """Attention dropout keeps the expectation: the mean over 400 independent draws (one batch of
    400 copies of the same item) is close to the exact output."""
    gen = torch.Generator().manual_seed(5)
    roles = random_batch(gen, 1, 40)
    q, k, v = qkv(gen, 1, 1, 40, 4)
    exact = qds_attention(q, k, v, build_layout(window=8, **roles))
    copies = {name: x.expand(400, *x.shape[1:]) for name, x in roles.items()}
    layout = build_layout(window=8, **copies)
    torch.manual_seed(0)
    dropped = qds_attention(*(x.expand(400, -1, -1, -1) for x in (q, k, v)), layout, dropout_p=0.5)
    assert not torch.allclose(dropped[0], exact[0])
    torch.testing.assert_close(dropped.mean(0), exact[0], atol=0.15, rtol=0)


# ---------------------------------------------------------------------------------------------
# The pattern itself
# ---------------------------------------------------------------------------------------------

def test_dense_mask_follows_equations_7_to_10():
    """Brute force over (i, j) on one small padded item: Eq. 7 local, Eq. 8 [SOS] keys,
    Eq. 9–10 query/[CLS] rows and keys, padding excluded; and the two ablations."""
    n, window, length = 16, 4, 14
    attention = torch.zeros(1, n, dtype=torch.bool)
    attention[0, :length] = True
    glob = torch.zeros_like(attention)
    glob[0, :3] = True                      # [CLS] q1 q2
    sent = torch.zeros_like(attention)
    sent[0, [4, 9]] = True                  # two sentences
    for pattern in PATTERNS:
        mask = dense_mask(attention, window, glob, sent, pattern)[0]
        for i in range(n):
            for j in range(n):
                want = abs(i - j) <= window // 2
                if pattern in ("qds", "longformer-qa"):
                    want |= bool(glob[0, i] or glob[0, j])
                if pattern == "qds":
                    want |= bool(sent[0, j])
                want &= i < length and j < length
                assert bool(mask[i, j]) == want, (pattern, i, j)


def test_roles_and_errors():
    attention = torch.tensor([[1, 1, 1, 0]])
    glob = torch.tensor([[1, 0, 0, 1]])          # a "global" padding token is ignored
    sent = torch.tensor([[0, 1, 0, 0]])
    valid, key_global, row_global = pattern_roles(attention, glob, sent, "qds")
    assert valid.tolist() == [[True, True, True, False]]
    assert key_global.tolist() == [[True, True, False, False]]
    assert row_global.tolist() == [[True, False, False, False]]
    with pytest.raises(ConfigError):
        build_layout(attention, 4, pattern="bigbird")
    with pytest.raises(ConfigError):
        build_layout(attention, -1)
    layout = build_layout(attention, 4, glob, sent)
    with pytest.raises(ValueError):
        qds_attention(*(torch.randn(1, 1, 5, 2) for _ in range(3)), layout)


# ---------------------------------------------------------------------------------------------
# Cost: nothing of size n × n, linear growth
# ---------------------------------------------------------------------------------------------

class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("n", [1024, 4096])
def test_no_n_by_n_tensor_is_ever_created(n: int):
    """Every intermediate of forward + backward (and of the layout) is O(n·(w + g)) elements —
    far below one head's n × n score matrix."""
    heads, dim, window = 2, 8, 64
    gen = torch.Generator().manual_seed(0)
    attention = torch.ones(1, n, dtype=torch.bool)
    glob = torch.zeros_like(attention)
    glob[:, :9] = True
    sent = torch.zeros_like(attention)
    sent[:, 10::100] = True                          # g grows with n, like a real document
    q, k, v = qkv(gen, 1, heads, n, dim)
    g = int(glob.sum() + sent.sum())
    with _LargestTensor() as probe:
        layout = build_layout(attention, window, glob, sent)
        out = qds_attention(q, k, v, layout)
        out.backward(torch.ones_like(out))
    bound = heads * n * (3 * (window // 2) + g)      # band scores (3 blocks of w/2) + global-key scores
    assert probe.largest <= bound
    assert probe.largest < heads * n * n / 8


def test_layout_grows_linearly():
    def layout_numel(n: int) -> int:
        attention = torch.ones(1, n, dtype=torch.bool)
        glob = torch.zeros_like(attention)
        glob[:, :5] = True
        layout = build_layout(attention, 32, glob)
        return sum(t.numel() for t in vars(layout).values() if isinstance(t, torch.Tensor))

    small, large = layout_numel(1024), layout_numel(8192)
    assert large / small == pytest.approx(8, rel=0.05)
    assert math.isfinite(large)
