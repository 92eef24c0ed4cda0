// 64 MiB ping-pong with separate send and receive buffers (as distcomm bench and any
// ownership-passing API uses them), blocking and nonblocking: the like-for-like MPI baseline for
// `DISTCOMM_BACKEND=mpi distcomm bench p2p --sizes 64M`. ../shared/bench/mpi_bench.c reuses one
// buffer for both directions, which keeps it in cache.
// Build: mpicc -O2 -o /tmp/nb_bench scripts/mpi_pingpong_two_buffers.c
// Run:   mpirun --allow-run-as-root -n 2 /tmp/nb_bench
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc,char**argv){
  MPI_Init(&argc,&argv); int rank; MPI_Comm_rank(MPI_COMM_WORLD,&rank);
  long n=64<<20; char*buf=malloc(n), *rb=malloc(n); memset(buf,1,n); memset(rb,1,n);
  for(int mode=0;mode<2;mode++){ double best=0; int it=8; double t0=0;
    for(int ph=0;ph<2;ph++){ int k=ph?it:3; MPI_Barrier(MPI_COMM_WORLD); t0=MPI_Wtime();
      for(int j=0;j<k;j++){ MPI_Request r[2]; int flag=0;
        if(mode==0){ if(rank==0){MPI_Send(buf,n,MPI_BYTE,1,0,MPI_COMM_WORLD);MPI_Recv(rb,n,MPI_BYTE,1,0,MPI_COMM_WORLD,MPI_STATUS_IGNORE);} else {MPI_Recv(rb,n,MPI_BYTE,0,0,MPI_COMM_WORLD,MPI_STATUS_IGNORE);MPI_Send(buf,n,MPI_BYTE,0,0,MPI_COMM_WORLD);} }
        else { if(rank==0){ MPI_Isend(buf,n,MPI_BYTE,1,0,MPI_COMM_WORLD,&r[0]); MPI_Irecv(rb,n,MPI_BYTE,1,0,MPI_COMM_WORLD,&r[1]); int d=0; while(!d) MPI_Testall(2,r,&d,MPI_STATUSES_IGNORE);} 
               else { MPI_Irecv(rb,n,MPI_BYTE,0,0,MPI_COMM_WORLD,&r[1]); while(!flag) MPI_Test(&r[1],&flag,MPI_STATUS_IGNORE); MPI_Isend(buf,n,MPI_BYTE,0,0,MPI_COMM_WORLD,&r[0]); flag=0; while(!flag) MPI_Test(&r[0],&flag,MPI_STATUS_IGNORE);} }
      } best=(MPI_Wtime()-t0)/it/2; }
    if(rank==0) printf("%s 64MiB half-rtt %.1f us %.3f GB/s\n", mode?"isend/irecv+test":"send/recv", best*1e6, n/best/1e9); }
  MPI_Finalize(); }
