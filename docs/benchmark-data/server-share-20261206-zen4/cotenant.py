import sys, time
busy_ms, period_ms = float(sys.argv[1]), float(sys.argv[2])
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < busy_ms / 1000: pass
    time.sleep(max(0, period_ms / 1000 - (time.perf_counter() - t0)))
