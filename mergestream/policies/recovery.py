"""Fitting a low-rank correction on a mask's kept entries only: the inner loop of SAFE-Merge's masked
low-rank recovery (:func:`.safe_merge.masked_recovery`, METHODS.md §safe_merge step 6).

The loop minimises ‖P + C W‖²_F over A (r, n) and B (m, r) with C = M⊙(B A), for a mask M (m, n),
W (n, K) and P (m, K) fixed. Its gradient is dL/dB = G Aᵀ, dL/dA = Bᵀ G with G = M ⊙ 2(P + C W) Wᵀ,
and C and G live only on the ρ·m·n kept entries, as sparse CSR matrices whose values are rewritten
in place (:class:`KeptPattern`): a step costs O(ρ·m·n·(r + K)) instead of the dense O(m·n·(r + K)).

Two of a step's products, C W and the sampling of G, gather one row of W per kept entry, in the
order of the entries' columns, which is random for a risk or magnitude mask. At K = 72 (a later
fold: k_new + k_old) W of a 4096-column matrix is 1.2 MB, more than a core's L2 cache, so every kept
entry waited on memory. The mask is therefore cut into column blocks whose rows of W fit in
:data:`BLOCK_BYTES` (:func:`column_blocks`), and each product runs block by block over W's rows of
that block: on one thread, a step at K = 72 went from 29 to 20 ms on a 2048x4096 matrix, 183 to 127 ms
on 4096x11008 and 165 to 133 ms on 11008x4096 (bench/recovery_blocks.py, bench/results/
recovery_blocks.md). At K = 8 (first folds) a W of up to 8192 rows fits: one block.
"""

from __future__ import annotations

import math
import warnings

import torch

from .base import Tensor

# torch marks sparse CSR as beta and says so on the first CSR tensor; the recovery depends only on
# sampled_addmm and CSR @ dense, which the tests check against the dense formulation.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)

#: Bytes of W's rows (float32) one column block may hold: a quarter of the 1 MiB L2 cache of the
#: cores we measured on, room left for the rows of P + C W and of A being streamed. A constant rather
#: than the machine's cache size, so the blocks, and so the bytes of a fold, are the same everywhere.
BLOCK_BYTES = 256 * 1024

#: Widest W (columns K) for which G's transpose is sampled directly rather than gathered from G's
#: values (:class:`KeptPattern`): K = k_new at a first fold (8 by default), k_new + k_old (72) later.
SAMPLE_T_MAX_K = 24

#: Most kept entries of a block whose Gᵀ is gathered from G's values even when K allows sampling
#: it: the gather reads G's values in random order, cheap while they stay in cache and not beyond
#: (K = 8, one thread, 2 GHz AVX2 EPYC: gather against sampling 2.4 / 3.4 ms at 0.84M entries
#: (2048x4096), 3.2 / 4.6 at 1.13M (2048x5504), 3.5 / 5.2 at 1.26M, 7.3 / 6.9 at 1.68M (4096²),
#: 41 / 18 at 4.5M (4096x11008)). On the CPU both give the same bits, so this only moves time.
GATHER_MAX_NNZ = 1_500_000


def _offsets(index: Tensor, size: int) -> Tensor:
    """CSR row offsets (size + 1,) int64 of a sorted-by-row index vector."""
    out = torch.zeros(size + 1, dtype=torch.int64, device=index.device)
    out[1:] = torch.bincount(index, minlength=size).cumsum(0)
    return out


class KeptPattern:
    """The kept entries of a mask M (m, n), or of its columns ``columns`` = [c0, c1), as sparse CSR
    matrices S (m, c1 − c0) and Sᵀ (c1 − c0, m) whose values are rewritten in place.

    ``sample`` sets S = α·M⊙(X Y) (``torch.sparse.sampled_addmm`` into S's own values); Sᵀ as CSR
    comes either from sampling it directly (``sample_t``) or from gathering S's values into column
    order (``transposed``): the gather costs the same whatever k, the sampling grows with k and is
    cheaper below about 24 columns (G sampled, then Gᵀ sampled or gathered, 1.1M kept entries, single
    thread: 5.8 against 8.1 ms at k = 8, 10.2 against 10.7 at k = 24, 24.3 against 20.3 at k = 72),
    unless S's values fit in cache, where the gather is cheaper at any k (:data:`GATHER_MAX_NNZ`).
    On the CPU both give the same bits (the same products summed in the same order). All reuse
    buffers allocated once, so a loop over them allocates nothing of size ρ·m·n per step.

    Attributes:
        values: (nnz,) S's values, in row-major order of the kept entries.
        flat: (nnz,) int64 positions of those entries in the whole of M flattened (row-major), for
            writing S's values into an (m, n) tensor with ``index_add_``.
        columns: the slice [c0, c1) of M's columns this pattern covers.

    The right-hand factor of a product is best passed as the transposed view of a contiguous
    (columns, k) matrix: ``sampled_addmm`` works on that layout and copies any other one first.
    """

    def __init__(self, mask: Tensor, dtype: torch.dtype = torch.float32,
                 columns: tuple[int, int] | None = None) -> None:
        m, n = mask.shape
        c0, c1 = columns or (0, n)
        width = c1 - c0
        self.columns = slice(c0, c1)
        local = mask[:, c0:c1].reshape(-1).nonzero().squeeze(1)
        rows, cols = local // width, local % width
        self.flat = local if width == n else rows * n + cols + c0
        self.nnz = int(local.numel())
        self.values = torch.zeros(self.nnz, dtype=dtype, device=mask.device)
        # int32 indices where they fit: the sparse kernels convert int64 ones on every call (a fresh
        # nnz-sized buffer per product), and index_select gathers Sᵀ's values 1.5x faster with them
        idx = torch.int32 if max(self.nnz, m, n) < 2**31 - 1 else torch.int64
        # column-major order of the same entries: a stable sort by column of entries already in row
        # order (a third of an argsort of col·m + row)
        cols_i = cols.to(idx)
        order = torch.sort(cols_i, stable=True).indices
        self._order = order.to(idx)
        self.s = torch.sparse_csr_tensor(_offsets(rows, m).to(idx), cols_i, self.values, size=(m, width),
                                         check_invariants=False)
        self.s_t = torch.sparse_csr_tensor(_offsets(cols, width).to(idx), rows[order].to(idx),
                                           torch.zeros_like(self.values), size=(width, m), check_invariants=False)

    def sample(self, x: Tensor, y: Tensor, alpha: float = 1.0) -> Tensor:
        """Set S = alpha · M⊙(x @ y) for x (m, k), y (k, width) and return S (sparse CSR)."""
        return torch.sparse.sampled_addmm(self.s, x, y, beta=0.0, alpha=alpha, out=self.s)

    def sample_t(self, x: Tensor, y: Tensor, alpha: float = 1.0) -> Tensor:
        """Set Sᵀ = alpha · Mᵀ⊙(x @ y) for x (width, k), y (k, m) and return Sᵀ (sparse CSR);
        S's own values are left alone."""
        return torch.sparse.sampled_addmm(self.s_t, x, y, beta=0.0, alpha=alpha, out=self.s_t)

    def transposed(self) -> Tensor:
        """Sᵀ (sparse CSR (width, m)) holding S's current values (gathered into column order)."""
        torch.index_select(self.values, 0, self._order, out=self.s_t.values())
        return self.s_t


def column_blocks(mask: Tensor, k: int) -> list[KeptPattern]:
    """The non-empty patterns of ``mask`` (m, n) bool cut into equal column blocks whose rows of a
    float32 (n, k) W fit in :data:`BLOCK_BYTES` (one block when all of W does, and always off the
    CPU: the budget is a CPU cache's, and a GPU would only pay more kernel launches); empty for an
    empty mask."""
    n = mask.shape[1]
    count = max(1, math.ceil(n * k * 4 / BLOCK_BYTES)) if mask.device.type == "cpu" else 1
    width = math.ceil(n / count)
    blocks = [KeptPattern(mask, columns=(c0, min(c0 + width, n))) for c0 in range(0, n, width)]
    return [b for b in blocks if b.nnz]


class PlainAdam:
    """Adam (Kingma & Ba, ICLR 2015, Algorithm 1; β₁ 0.9, β₂ 0.999, ε 1e-8, no weight decay) on
    preallocated moment buffers, for parameters whose gradients the caller writes into ``grads``.

    The same arithmetic as ``torch.optim.Adam``'s single-tensor step (step for step the same values:
    tests/test_policies.py), without its per-step dispatch, which costs more than the sparse
    products of a recovery step on a 2048x4096 matrix (about 1.8 ms against 0.1 ms per step).

    Args:
        params: float32 tensors updated in place.
        lr: learning rate.
    """

    def __init__(self, params: list[Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.grads = [torch.zeros_like(p) for p in params]
        self._m = [torch.zeros_like(p) for p in params]
        self._v = [torch.zeros_like(p) for p in params]
        self._denom = [torch.empty_like(p) for p in params]
        self.t = 0

    def step(self) -> None:
        """One update of every parameter from the gradients now in :attr:`grads`."""
        self.t += 1
        b1, b2 = self.betas
        bias1, bias2_sqrt = 1 - b1**self.t, (1 - b2**self.t) ** 0.5
        for p, g, m, v, d in zip(self.params, self.grads, self._m, self._v, self._denom):
            m.lerp_(g, 1 - b1)  # first moment
            v.mul_(b2).addcmul_(g, g, value=1 - b2)  # second moment
            torch.sqrt(v, out=d).div_(bias2_sqrt).add_(self.eps)
            p.addcdiv_(m, d, value=-self.lr / bias1)


def fit_on_mask(blocks: list[KeptPattern], w: Tensor, p: Tensor, a_t: Tensor, b: Tensor, *, steps: int,
                lr: float) -> list[float]:
    """Fit A, B to minimise L = ‖P + (M⊙(B A)) W‖²_F with ``steps`` steps of :class:`PlainAdam`.

    Args:
        blocks: M's kept entries (:func:`column_blocks` of the mask, with ``w``'s K).
        w: W (n, K) float32, contiguous; p: P (m, K) float32.
        a_t: Aᵀ (n, r) float32, contiguous, updated in place (A is kept transposed: the layout the
            sampled products read without a copy; Adam is element-wise, so updating Aᵀ with dL/dAᵀ
            is the same as updating A with dL/dA).
        b: B (m, r) float32, updated in place.
        lr: Adam's learning rate.

    Returns:
        L after each step, the first before any step (``steps + 1`` values). On return every
        block's values hold M⊙(B A) of the final A, B.
    """
    resid = torch.empty_like(p)
    opt = PlainAdam([a_t, b], lr=lr)
    grad_a_t, grad_b = opt.grads  # rows of Aᵀ for columns in no block keep their zero gradient
    narrow = w.shape[1] <= SAMPLE_T_MAX_K
    # each block's rows of W, Aᵀ and dL/dAᵀ, as views taken once (Adam updates Aᵀ in place), and
    # whether its Gᵀ is sampled (else gathered from G's values: the same bits)
    views = [(blk, w[blk.columns], a_t[blk.columns], grad_a_t[blk.columns], narrow and blk.nnz > GATHER_MAX_NNZ)
             for blk in blocks]
    losses: list[float] = []
    with torch.no_grad():
        for _ in range(steps + 1):
            resid.copy_(p)
            for blk, w_blk, a_blk, _, _ in views:  # R = P + C W, (m, K)
                resid.addmm_(blk.sample(b, a_blk.T), w_blk)
            flat_r = resid.view(-1)
            losses.append(float(torch.dot(flat_r, flat_r)))
            if len(losses) > steps:
                break
            # G = M ⊙ 2 R Wᵀ: dL/dB = G Aᵀ, dL/dAᵀ = Gᵀ B with Gᵀ = Mᵀ ⊙ 2 W Rᵀ
            for i, (blk, w_blk, a_blk, grad_a_blk, sample_t) in enumerate(views):
                g = blk.sample(resid, w_blk.T, alpha=2.0)
                if i == 0:
                    torch.mm(g, a_blk, out=grad_b)
                else:
                    grad_b.addmm_(g, a_blk)
                g_t = blk.sample_t(w_blk, resid.T, alpha=2.0) if sample_t else blk.transposed()
                torch.mm(g_t, b, out=grad_a_blk)
            opt.step()
    # the last pass computed R from the final A, B, so every block's values hold M⊙(B A) already
    return losses
