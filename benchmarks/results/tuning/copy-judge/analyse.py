import json, sys, math
for f in sys.argv[1:]:
    d = json.load(open(f)); recs = d["records"]; res = d["results"]
    budgets = list(res["own"])
    # records come in bench order; group by budget value order of appearance per window hash
    wins = []
    for r in recs:
        if r["window"] not in wins: wins.append(r["window"])
    from collections import defaultdict
    by = defaultdict(list)
    for r in recs: by[r["budget"]].append(r)
    bt = d["results"]["own"]
    print("==", f)
    for b in budgets:
        own_true, wo_true = res["own"][b]["per_window"]["kl"], res["without"][b]["per_window"]["kl"]
        # find budget tokens: records with matching order
        line = []
        for i, (o, w) in enumerate(zip(own_true, wo_true)):
            line.append(f"true {w/o:.2f}")
        print(b, " ".join(line))
    for budget, rs in by.items():
        out = []
        for r in rs:
            a, c = r["per_token"][0], r["per_token"][1]
            ma, mc = sum(a)/len(a), sum(c)/len(c)
            diff = [x - y for x, y in zip(c, a)]
            md = sum(diff)/len(diff); sd = (sum((x-md)**2 for x in diff)/(len(diff)-1))**.5
            out.append(f"judge {mc/ma:.2f} (t={md/(sd/len(diff)**.5+1e-12):+.1f})")
        print("budget", budget, " ".join(out))
