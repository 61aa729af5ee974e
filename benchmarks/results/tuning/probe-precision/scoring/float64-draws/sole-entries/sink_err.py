"""For entries holding > half a row's attention: score terms y = a/(1-a) e.(o - v_j) three ways."""
import sys, torch
import klevict_cli.policies.kl as P
orig = P.kl_scores
acc = []
def wrapped(weights, outputs, values, readout, kv_heads, **kw):
    out = orig(weights, outputs, values, readout, kv_heads, **kw)
    if readout.dtype == torch.bfloat16 and values.shape[0] == kv_heads:
        hq, w, c = weights.shape; g = hq // kv_heads
        vq = values.float().repeat_interleave(g, dim=0)  # (hq, c, dv)
        e = readout.float().permute(2, 0, 1, 3)  # hq w r dv
        a, j = weights.max(dim=-1)  # hq w
        m = a > 0.5
        if m.any():
            h, t = m.nonzero(as_tuple=True); jj = j[h, t]
            vj = vq[h, jj]
            o_given = outputs[h, t].float()
            o_exact = torch.einsum("kc,kcd->kd", weights[h, t].float(), vq[h])
            coef = (a[h, t] / (1 - a[h, t]))[:, None]
            eb = readout.permute(2, 0, 1, 3)[h, t]  # bf16 (k, r, dv)
            y_bf = coef * (torch.einsum("krd,kd->kr", eb, outputs[h, t].to(eb.dtype)).float() - torch.einsum("krd,kd->kr", eb, vj.to(eb.dtype)).float())
            y_given = coef * torch.einsum("krd,kd->kr", e[h, t], o_given - vj)
            y_exact = coef * torch.einsum("krd,kd->kr", e[h, t], o_exact - vj)
            acc.append((a[h, t], y_bf.square().sum(1), y_given.square().sum(1), y_exact.square().sum(1), (o_given - o_exact).norm(dim=1) / vj.norm(dim=1)))
    return out
P.kl_scores = wrapped
import atexit
def report():
    a, bf, gv, ex, od = (torch.cat(x) for x in zip(*acc))
    for lo, hi in ((0.5, 0.9), (0.9, 0.99), (0.99, 0.999), (0.999, 1.01)):
        s = (a >= lo) & (a < hi)
        if s.sum() == 0: continue
        r = lambda x: (x[s] / ex[s].clamp_min(1e-30))
        print(f"a in [{lo},{hi}): n {s.sum().item()}  median bf/exact {r(bf).median():.3f} p99 {r(bf).quantile(.99):.1f} max {r(bf).max():.1f} | given/exact median {r(gv).median():.3f} p99 {r(gv).quantile(.99):.2f} max {r(gv).max():.1f} | |o-o_exact|/|v| median {od[s].median():.2e}", file=sys.stderr)
atexit.register(report)
from klevict_cli.cli import app
app()
