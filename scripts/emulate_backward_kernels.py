"""Lane-level numpy emulation of the index math of cuda/sddmm.cu and cuda/spmm_t.cu, on the CPU.

It replays each kernel's tiling, staging, gather/expansion, ldmatrix (.trans) lane addresses, mma.m16n8k16
fragment layouts, scatter and epilogue as the PTX ISA documents those instructions, and compares with the
dense float reference. It checks the kernels' index arithmetic, not the hardware. Slow (about a minute
per spec); shapes have token and group tails.

  python scripts/emulate_backward_kernels.py 2:4 64:2:8 128:2:16 64:2:32
"""
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), ".."))
from jaxsparse import format as F

def ldmatrix(mats_rows, trans):
    # mats_rows[j][i] = 8-element row vector at the address lane 8j+i provides. returns regs[lane][j] = (lo, hi)
    out = np.zeros((32, 4, 2))
    for lane in range(32):
        for j in range(4):
            M = np.array(mats_rows[j])  # 8x8 stored
            if not trans:
                out[lane, j] = M[lane // 4, 2 * (lane % 4): 2 * (lane % 4) + 2]
            else:
                out[lane, j] = [M[2 * (lane % 4), lane // 4], M[2 * (lane % 4) + 1, lane // 4]]
    return out

def mma(d, a, b0, b1):
    # d [32][4], a [32][4][2], b0/b1 [32][2]: rebuild A 16x16, B 16x8, accumulate
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2*t:2*t+2] = a[lane][0]; A[g+8, 2*t:2*t+2] = a[lane][1]
        A[g, 2*t+8:2*t+10] = a[lane][2]; A[g+8, 2*t+8:2*t+10] = a[lane][3]
        B[2*t:2*t+2, g] = b0[lane]; B[2*t+8:2*t+10, g] = b1[lane]
    D = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        d[lane] += [D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]]

def load_frag(smem2d, row_of, col_of, trans):
    # smem2d: 2D element array; lane l gives address (row_of(l), col_of(l)) -> row of 8 elements
    mats = [[None]*8 for _ in range(4)]
    for l in range(32):
        r, c = row_of(l), col_of(l)
        mats[l >> 3][l & 7] = smem2d[r, c:c+8]
    return ldmatrix(mats, trans)

def emu_spmm_t(dy, values, cols, meta, V, M, WARPS_M, WARPS_N):
    T, R = dy.shape; G = values.shape[1] // 2; K = G * M
    BT, RS, W = 64, 32, 256; GC = W // M; NC = 4 * GC
    WM, WN = BT // WARPS_M, NC // WARPS_N; MI, NI = WM // 16, WN // 8
    dx = np.full((T, K), np.nan)
    for bx in range((T + BT - 1) // BT):
        for by in range((G + GC - 1) // GC):
            tok0, g0 = bx * BT, by * GC
            acc_s = np.zeros((BT, W + 4))
            accs = {w: np.zeros((MI, NI, 32, 4)) for w in range(8)}
            for kt in range(R // RS):
                r0 = kt * RS
                dys = np.zeros((BT, RS + 8))
                for t in range(BT):
                    if tok0 + t < T: dys[t, :RS] = dy[tok0 + t, r0:r0 + RS]
                vals = np.zeros((RS, 2 * GC)); mt = np.zeros((RS, GC // 8), np.uint32); cw = np.zeros(GC, np.uint32)
                for c in range(GC // 4):
                    if g0 + 4 * c < G:
                        vals[:, 8*c:8*c+8] = values[r0:r0+RS, 2*(g0+4*c):2*(g0+4*c)+8]
                        if M > 4: cw[4*c:4*c+4] = np.ascontiguousarray(cols).view(np.uint32)[r0 // V, g0+4*c:g0+4*c+4, 0]
                for c in range(GC // 8):
                    if g0 + 8 * c < G: mt[:, c] = meta[r0:r0+RS, g0 // 8 + c]
                Ac = np.zeros((RS, NC + 8))
                for row in range(RS):
                    for gl in range(GC):
                        nib = (int(mt[row, gl >> 3]) >> (4 * (gl & 7))) & 0xF
                        p0, p1 = nib & 3, nib >> 2
                        for q in range(4):
                            Ac[row, 4*gl+q] = vals[row, 2*gl+1] if p1 == q else (vals[row, 2*gl] if p0 == q else 0)
                for warp in range(8):
                    wm, wn = warp % WARPS_M, warp // WARPS_M
                    acc = accs[warp]
                    for ks in range(RS // 16):
                        a = [load_frag(dys, lambda l, mi=mi: wm*WM + mi*16 + (l & 7) + ((l >> 3) & 1) * 8,
                                       lambda l: ks*16 + (l >> 4) * 8, False) for mi in range(MI)]
                        b = [None] * NI
                        for nj in range(NI // 2):
                            f = load_frag(Ac, lambda l: ks*16 + ((l >> 3) & 1) * 8 + (l & 7),
                                          lambda l, nj=nj: wn*WN + nj*16 + (l >> 4) * 8, True)
                            b[2*nj] = (f[:, 0], f[:, 1]); b[2*nj+1] = (f[:, 2], f[:, 3])
                        for mi in range(MI):
                            for ni in range(NI):
                                mma(acc[mi, ni], a[mi], *b[ni])
                    block_end = (kt == R // RS - 1) if M == 4 else (((kt + 1) * RS) % V == 0)
                    if block_end:
                        for lane in range(32):
                            gid, tig = lane >> 2, lane & 3
                            for ni in range(NI):
                                q = wn*WN + ni*8 + 2*tig; gl, pos = q >> 2, q & 3
                                c0, c1 = pos, pos + 1
                                if M > 4:
                                    w = int(cw[gl]); c0 = (w >> (8*pos)) & 0xFF; c1 = (w >> (8*pos+8)) & 0xFF
                                for mi in range(MI):
                                    for h in range(2):
                                        t = wm*WM + mi*16 + gid + h*8
                                        acc_s[t, gl*M + c0] += acc[mi, ni, lane, 2*h]
                                        acc_s[t, gl*M + c1] += acc[mi, ni, lane, 2*h+1]
                                        acc[mi, ni, lane, 2*h] = 0; acc[mi, ni, lane, 2*h+1] = 0
            for t in range(BT):
                for c in range(W // 8):
                    if tok0 + t < T and g0*M + c*8 < K:
                        dx[tok0 + t, g0*M + c*8: g0*M + c*8 + 8] = acc_s[t, c*8:c*8+8]
    return dx

def emu_sddmm(x, dy, cols, meta, V, M, GC, WARPS_M, WARPS_N, splits=1):
    """``splits`` > 1: grid.z token ranges of ``kt_per_split`` tiles, float32 partials summed in order."""
    T, K = x.shape; R = dy.shape[1]; G = K // M
    BR, BT = 64, 32; NC = 4 * GC; W = GC * M
    WM, WN = BR // WARPS_M, NC // WARPS_N; MI, NI = WM // 16, WN // 8
    all_kt = (T + BT - 1) // BT
    kt_per = (all_kt + splits - 1) // splits if splits > 1 else max(all_kt, 1)
    nz = (all_kt + kt_per - 1) // kt_per if splits > 1 else 1
    partial = np.full((nz, R, 2 * G), np.nan)
    for bz in range(nz):
      kt_begin = bz * kt_per
      num_kt = max(min(all_kt - kt_begin, kt_per), 0)
      out = partial[bz]
      for bx in range(R // BR):
        for by in range((G + GC - 1) // GC):
            row0, g0 = bx * BR, by * GC
            accs = {w: np.zeros((MI, NI, 32, 4)) for w in range(8)}
            offs = {}
            for cq in range(NC // 2):
                gl, pos = cq >> 1, 2 * (cq & 1)
                w = 0
                if M > 4 and g0 + gl < G:
                    cb = cols[row0 // V, g0 + gl]; w = int(cb[0]) | int(cb[1]) << 8 | int(cb[2]) << 16 | int(cb[3]) << 24
                offs[cq] = (gl*M + ((w >> (8*pos)) & 0xFF), gl*M + ((w >> (8*pos+8)) & 0xFF))
            for kt in range(kt_begin, kt_begin + num_kt):
                t0 = kt * BT
                dys = np.zeros((BT, BR + 8)); xs = np.zeros((BT, W + 8))
                for t in range(BT):
                    if t0 + t < T:
                        dys[t, :BR] = dy[t0 + t, row0:row0 + BR]
                        for c in range(W // 8):
                            if g0 + (c * 8) // M < G: xs[t, c*8:c*8+8] = x[t0 + t, g0*M + c*8: g0*M + c*8 + 8]
                if M > 4:
                    xc = np.zeros((BT, NC + 8))
                    for t in range(BT):
                        for cq in range(NC // 2):
                            xc[t, 2*cq] = xs[t, offs[cq][0]]; xc[t, 2*cq+1] = xs[t, offs[cq][1]]
                else:
                    xc = xs
                for warp in range(8):
                    wm, wn = warp % WARPS_M, warp // WARPS_M
                    acc = accs[warp]
                    for ks in range(BT // 16):
                        a = [load_frag(dys, lambda l: ks*16 + ((l >> 4) & 1) * 8 + (l & 7),
                                       lambda l, mi=mi: wm*WM + mi*16 + ((l >> 3) & 1) * 8, True) for mi in range(MI)]
                        b = [None] * NI
                        for nj in range(NI // 2):
                            f = load_frag(xc, lambda l: ks*16 + ((l >> 3) & 1) * 8 + (l & 7),
                                          lambda l, nj=nj: wn*WN + nj*16 + (l >> 4) * 8, True)
                            b[2*nj] = (f[:, 0], f[:, 1]); b[2*nj+1] = (f[:, 2], f[:, 3])
                        for mi in range(MI):
                            for ni in range(NI):
                                mma(acc[mi, ni], a[mi], *b[ni])
            tile = np.zeros((BR, NC + 4))
            for warp in range(8):
                wm, wn = warp % WARPS_M, warp // WARPS_M
                for lane in range(32):
                    gid, tig = lane >> 2, lane & 3
                    for mi in range(MI):
                        for ni in range(NI):
                            for q in range(4):
                                tile[wm*WM + mi*16 + gid + (q >> 1)*8, wn*WN + ni*8 + 2*tig + (q & 1)] = accs[warp][mi, ni, lane, q]
            for r in range(BR):
                for gl in range(GC):
                    g = g0 + gl
                    if g >= G: continue
                    nib = (int(meta[row0 + r, g // 8]) >> (4 * (g % 8))) & 0xF
                    out[row0 + r, 2*g] = tile[r, 4*gl + (nib & 3)]; out[row0 + r, 2*g+1] = tile[r, 4*gl + (nib >> 2)]
    total = partial[0].copy()
    for bz in range(1, nz):  # SddmmReduceKernel: the ranges in order
        total += partial[bz]
    return total

CFG_SD = {4: (32, 2, 4), 8: (32, 2, 4), 16: (16, 4, 2), 32: (8, 4, 2)}
CFG_ST = {4: (2, 4), 8: (2, 4), 16: (4, 2), 32: (4, 2)}
for spec in sys.argv[1:]:
    s = F.VNM.parse(spec); M, V = s.m, s.v
    K = 24 * 32 if M == 32 else 40 * M; R = 128 if V <= 64 else 256; T = 70
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, K)).astype(np.float32); dy = rng.standard_normal((T, R)).astype(np.float32)
    w = rng.standard_normal((K, R)).astype(np.float32)
    sw = F.compress(jnp.asarray(w), F.select_mask(jnp.asarray(w), s), s)
    vals = np.asarray(sw.values); meta = np.asarray(sw.metadata); cols = None if sw.columns is None else np.asarray(sw.columns)
    dense = np.asarray(F.decompress(sw))
    ref_dx = dy @ dense.T
    got = emu_spmm_t(dy, vals, cols, meta, V, M, *CFG_ST[M])
    ref_dv = np.asarray(F.compress_like(jnp.asarray(x.T @ dy), sw))
    got_dv = emu_sddmm(x, dy, cols, meta, V, M, *CFG_SD[M])
    got_split = emu_sddmm(x, dy, cols, meta, V, M, *CFG_SD[M], splits=2)  # T = 70: 3 tiles -> ranges of 2 and 1
    err = lambda a, b: np.nanmax(np.abs(a - b)) if not np.isnan(a).any() else "NaN"  # noqa: E731
    print(spec, "spmm_t err", err(got, ref_dx), "sddmm err", err(got_dv, ref_dv),
          "sddmm split 2 err", err(got_split, ref_dv), flush=True)
