"""Kernel-list probe (issue 16): a hand-written layer compiled under fa3 and stock Inductor, max-autotune;
times both and lists the kernels each compile launches. Argument: the backends in compile order."""
import sys, os, torch, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))        # benchmarks/, for first_use
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository
import fa3_inductor, triton
from first_use import HandWrittenLayer
from torch.profiler import profile, ProfilerActivity
torch.manual_seed(0)
layer = HandWrittenLayer(2048, 16).cuda().to(torch.bfloat16).eval()
x = torch.randn(1, 1024, 2048, device="cuda", dtype=torch.bfloat16)
order = sys.argv[1].split(",")
fns = {}
with torch.no_grad():
    for be in order:
        f = torch.compile(layer, backend=be, mode="max-autotune")
        t0 = time.time(); f(x); torch.cuda.synchronize(); print(be, "compile", time.time() - t0)
        fns[be] = f
    for r in range(3):
        for be, f in fns.items():
            print(be, "ms", triton.testing.do_bench(lambda: f(x), warmup=10, rep=50, return_mode="median"))
    for be, f in fns.items():
        for _ in range(5): f(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20): f(x)
            torch.cuda.synchronize()
        print("=====", be)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
