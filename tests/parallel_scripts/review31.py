"""Run under mpiexec (tests/test_signals31.py): each rank writes its pid to OUT/pid<rank>,
then idles (bounded: it ends by itself after 60 s); Ctrl-C ends it quietly."""
import os
import sys
import time

out = sys.argv[1]
rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
try:
    time.sleep(60)
except KeyboardInterrupt:
    sys.exit(130)
