#!/bin/bash
# What landing bytes in fresh tmpfs pages costs any receiver on this machine: iperf3 over
# loopback, 1 GiB, plain vs its server writing what it receives into a new /dev/shm file (-F),
# 3 rounds, the guest's free memory touched and freed right before each round (as bench/swarm's
# --pretouch). Lines "mode round MB/s ..." to /tmp/ipf.txt (bench/results/iperf3-shm-file.1202c.json
# holds one run of it). Run from the repository root; needs iperf3.
set -e
for r in 1 2 3; do
  .venv/bin/python - <<'PY'
import mmap, os
avail = int([l for l in open('/proc/meminfo') if l.startswith('MemAvailable')][0].split()[1]) * 1024
n = avail - (3 << 29)
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for off in range(0, n, 4096):
    m[off] = 1
m.close()
PY
  for mode in plain file; do
    rm -f /dev/shm/ipf.bin
    if [ $mode = file ]; then iperf3 -s -1 -p 5299 -F /dev/shm/ipf.bin >/dev/null 2>&1 & else iperf3 -s -1 -p 5299 >/dev/null 2>&1 & fi
    sleep 0.5
    out=$(iperf3 -c 127.0.0.1 -p 5299 -n 1G -f M -J)
    wait
    echo "$mode $r $(echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); e=d["end"]; print(round(e["sum_received"]["bits_per_second"]/8/1e6), "MB/s", "server cpu %", round(e["cpu_utilization_percent"]["remote_total"],1), "size", __import__("os").path.getsize("/dev/shm/ipf.bin") if __import__("os").path.exists("/dev/shm/ipf.bin") else 0)')" | tee -a /tmp/ipf.txt
  done
done
rm -f /dev/shm/ipf.bin
