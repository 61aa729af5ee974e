"""Compare kl_scores at bf16 (as shipped), bf16 with centred values, and f32, on every scoring call of a read."""
import sys, torch
import klevict_cli.policies.kl as P
from klevict_kernels import kl as K
orig = P.kl_scores
stats = []
def centred(weights, outputs, values, readout, kv_heads, **kw):
    # subtract each value head's attention-weighted mean value from values and outputs (per query head group)
    hq = weights.shape[0]; vh = values.shape[0]
    m = values.float().mean(dim=1, keepdim=True)  # (vh,1,Dv)
    mq = m.repeat_interleave(hq // vh, dim=0)  # (hq,1,Dv)
    return orig(weights, (outputs.float() - mq), (values.float() - m), readout, kv_heads, **kw)
def wrapped(weights, outputs, values, readout, kv_heads, **kw):
    out = orig(weights, outputs, values, readout, kv_heads, **kw)
    if readout.dtype == torch.bfloat16:
        ref = orig(weights, outputs.float(), values.float(), readout.float(), kv_heads, **kw)
        cen = centred(weights, outputs, values, readout, kv_heads, **kw)
        valid = ref > 0
        for name, s in (("bf16", out), ("centred", cen)):
            rel = ((s - ref).abs() / ref.clamp_min(1e-30))[valid]
            # rank agreement: fraction of bottom-half by ref also bottom-half by s
            if name == "bf16" and ((s - ref).abs().sum() / ref.abs().sum()).item() > 0.1:
                print("OUTLIER", tuple(weights.shape), tuple(readout.shape), kw.get("fold_probes"), f"ref sum {ref.sum().item():.3e} max {ref.max().item():.3e} s sum {s.sum().item():.3e} max {s.max().item():.3e} readout absmax {readout.abs().max().item():.3e} values absmax {values.abs().max().item():.3e}", file=sys.stderr)
            stats.append((name, ref.numel(), rel.median().item(), rel.quantile(0.9).item() if rel.numel() < 16_000_000 else float('nan'),
                          ((s - ref).abs().sum() / ref.abs().sum()).item()))
    return out
P.kl_scores = wrapped
import atexit
def report():
    import collections
    by = collections.defaultdict(list)
    for name, n, med, q9, l1 in stats: by[name].append((med, q9, l1))
    for name, rows in by.items():
        t = torch.tensor(rows)
        print(f"{name}: calls {len(rows)} median rel {t[:,0].median():.4f} p90 rel {t[:,1].nanmedian():.4f} L1 rel {t[:,2].median():.4f} (max {t[:,2].max():.4f})", file=sys.stderr)
    # by call index thirds
    rows = [r for r in stats if r[0] == "bf16"]
    k = len(rows)
    for part in range(3):
        seg = rows[part * k // 3:(part + 1) * k // 3]
        if seg: print(f" bf16 part {part}: L1 rel {torch.tensor([r[4] for r in seg]).median():.4f}", file=sys.stderr)
atexit.register(report)
from klevict_cli.cli import app
app()
