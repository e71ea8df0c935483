"""What each rank of `python -m needle.parallel.launch` runs: MPI started first, then the
script under mpi4py's runner, which aborts the whole job when the script raises or exits
with an error.

    mpiexec -n 2 python -m needle.parallel.rank train.py [script args...]

mpi4py's runner aborts only where MPI is running, and needle starts it at the script's first
Communicator: a rank that failed before that (its data, arguments or checkpoint) left its
peers waiting in MPI's start-up for it, with no timeout.
"""
from mpi4py import MPI  # noqa: F401 - MPI started before the script, whatever it does first
from mpi4py.run import main

if __name__ == "__main__":
    main()
