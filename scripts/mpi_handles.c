// Open MPI's ping-pong with nonblocking calls, the counterpart of `distcomm bench p2p --handles`:
// rank 0 posts MPI_Irecv and MPI_Isend and waits for both, rank 1 waits for its MPI_Irecv, then
// sends back with MPI_Isend + MPI_Wait. Same output format as ../shared/bench/mpi_bench.c
// (time = half a round trip, mean over the timed loop), so scripts/compare.py reads either.
// Build: mpicc -O2 -o /tmp/mpi_handles scripts/mpi_handles.c
// Run:   mpirun --allow-run-as-root -n 2 /tmp/mpi_handles
// With -DTHREAD_MULTIPLE it asks for MPI_THREAD_MULTIPLE (every call safe from any thread, as
// distcomm's handles always are) and fails if the library does not give it.
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int iters_for(long n) { return n <= 1024 ? 20000 : n <= 65536 ? 2000 : n <= (1 << 20) ? 200 : 10; }

int main(int argc, char **argv) {
#ifdef THREAD_MULTIPLE
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided != MPI_THREAD_MULTIPLE) {
    fprintf(stderr,
            "mpi_handles: this MPI gives thread level %d, not MPI_THREAD_MULTIPLE (%d); use an MPI "
            "built with thread support, or build without -DTHREAD_MULTIPLE\n",
            provided, MPI_THREAD_MULTIPLE);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
#else
  MPI_Init(&argc, &argv);
#endif
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  long sizes[] = {8, 1024, 65536, 1 << 20, 16 << 20, 64 << 20};
  char *out = malloc(64 << 20), *in = malloc(64 << 20);
  memset(out, 1, 64 << 20);
  memset(in, 0, 64 << 20);
  for (int i = 0; i < 6; i++) {
    long n = sizes[i];
    int it = iters_for(n);
    double dt = 0;
    for (int timed = 0; timed < 2; timed++) {  // a warm-up loop, then the timed one
      int k = timed ? it : it / 10 + 1;
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      for (int j = 0; j < k; j++) {
        MPI_Request r[2];
        if (rank == 0) {
          MPI_Irecv(in, n, MPI_BYTE, 1, 1, MPI_COMM_WORLD, &r[0]);
          MPI_Isend(out, n, MPI_BYTE, 1, 0, MPI_COMM_WORLD, &r[1]);
          MPI_Waitall(2, r, MPI_STATUSES_IGNORE);
        } else if (rank == 1) {
          MPI_Irecv(in, n, MPI_BYTE, 0, 0, MPI_COMM_WORLD, &r[0]);
          MPI_Wait(&r[0], MPI_STATUS_IGNORE);
          MPI_Isend(in, n, MPI_BYTE, 0, 1, MPI_COMM_WORLD, &r[1]);
          MPI_Wait(&r[1], MPI_STATUS_IGNORE);
        }
      }
      dt = MPI_Wtime() - t0;
    }
    if (rank == 0) {
      double half = dt / it / 2;
      printf("mpi world=%d pingpong  %10ld B  %10.2f us  %7.3f GB/s\n", world, n, half * 1e6, n / half / 1e9);
    }
  }
  free(out);
  free(in);
  MPI_Finalize();
  return 0;
}
