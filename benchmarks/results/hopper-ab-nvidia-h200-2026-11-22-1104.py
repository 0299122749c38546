"""Same-run A/B of the sm90 kernel at 207d97d (fa3_old) against the working tree (fa3_inductor)."""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, triton
import fa3_old.templates.hopper as old_h
import fa3_old.templates.modgen as old_g
import fa3_inductor.templates.hopper as new_h
import fa3_inductor.templates.modgen as new_g
from fa3_inductor.recognition.canonical import dense_block_mask
from fa3_inductor import mods
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
D, H = 128, 16
def gen(g, fn):
    gm, bufs = g.trace_mod(fn, "mask")
    return g.load_mod(g.generate_mod_source(gm, "mask", [g.BufferSpec.of(b) for b in bufs], "gl"), "gl"), tuple(bufs)
for S, name in [(8192, "noop"), (8192, "causal"), (4096, "causal"), (2048, "causal"), (16384, "causal"), (8192, "window"), (2048, "document")]:
    B = max(1, 16384 // S)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q); lse = torch.empty(B, H, S, device="cuda"); mx = torch.empty_like(lse)
    qi = torch.arange(S, device="cuda")[:, None]; ki = torch.arange(S, device="cuda")[None, :]
    g = torch.Generator().manual_seed(0)
    doc = torch.repeat_interleave(torch.arange(S), torch.randint(1, S // 2 + 1, (S,), generator=g))[:S].to(torch.int32).cuda()
    fn = {"noop": None, "causal": mods.causal, "window": mods.sliding_window(256), "document": mods.document(doc)}[name]
    launches = {}
    for tag, h_, g_ in (("old", old_h, old_g), ("new", new_h, new_g)):
        kw = {}
        if fn is not None:
            mm, bufs = gen(g_, fn)
            bm = dense_block_mask(torch.broadcast_to(fn(0, 0, qi, ki), (S, S)), 1, 1, S, S, "cuda")
            kw = dict(mask_mod=mm, mask_bufs=bufs, kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                      full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
        launches[tag] = (lambda h_=h_, kw=kw: h_.launch_fwd_sm90(q, k, v, out, lse, mx, sm_scale=D ** -0.5, max_needed=False, **kw))
        launches[tag](); torch.cuda.synchronize()
    times = {t: [] for t in launches}
    for r in range(5):
        for t in (list(launches) if r % 2 == 0 else list(launches)[::-1]):
            times[t].append(triton.testing.do_bench(launches[t], warmup=25, rep=100))
    med = {t: sorted(v)[2] for t, v in times.items()}
    print(f"S{S} {name:9s} old {med['old']*1e3:8.1f} us  new {med['new']*1e3:8.1f} us  new/old time {med['new']/med['old']:.3f}  "
          f"rounds old {'/'.join(f'{x*1e3:.0f}' for x in times['old'])} new {'/'.join(f'{x*1e3:.0f}' for x in times['new'])}", flush=True)
