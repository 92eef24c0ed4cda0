// The memory-traffic floor of the shared-memory arena's small steps on this machine: two
// processes doing only what the arena's steps move between caches, without distcomm's calls
// around them. What `distcomm bench <op> -n 2` takes beyond these figures is the library's own
// work per call (dispatch, checks, bookkeeping), not the hardware's.
//
//   exchange  every step, each rank writes 8 bytes and its sequence number into its control
//             line of the step (one of 128, as the arena's) and waits for the other's: the
//             arena's all_reduce, all_gather, barrier of up to 32 bytes.
//   slots     the same with 1 KiB: data copied into the rank's slot of the step's parity, the
//             sequence number in the control line, the other's slot summed (f32) into the
//             buffer: the arena's all_reduce of 1 KiB.
//   slots-nt  `slots` with the copy into the slot by non-temporal stores.
//   slots-claim  `slots`, each rank taking its slot of the next step for writing (PREFETCHW)
//             after the step.
//   stream    rank 0 writes 8 bytes a step into its control lines, running at most 64 steps
//             ahead; rank 1 waits for each: the arena's small broadcast or scatter.
//
// And the point-to-point lane's ping-pong (each step a round trip; printed per message):
//   lane      each rank writes its message line and waits for the other's (Open MPI's fastbox
//             ping-pong: nothing follows a message).
//   lane-answer  the receiver of a message also writes its answer word (a line of its own,
//             which the sender waits on before it looks for the reply) before it replies: the
//             lane's protocol.
//   lane-rmw  `lane-answer` with a locked read-modify-write of a private word between the answer
//             and the reply, as the engine's lock taken between them does (on x86 it waits for
//             the answer's store to leave the store buffer).
//
// Build: gcc -O2 -mavx2 -mprfchw -o /tmp/arena_bound scripts/arena_bound.c
// Run:   /tmp/arena_bound [MODE ...]  (every mode above by default)
// Prints ns per step, for the lane modes per message (median of 5 runs of 100k steps after 1k
// warm-up steps). These machines switch between two placements of their two vCPUs from minute
// to minute: read `../shared/bench/limits shm-lat` before and after, as for every table.
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LINES 128
#define LEAD 64
#define SLOT 1024
#define STEPS 100000
#define WARM 1000

typedef struct { volatile uint64_t seq; uint64_t data; uint64_t pad[6]; } line_t;
typedef struct { line_t line[LINES]; line_t pos; char slot[2][SLOT]; } rank_t;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static void wait_seq(line_t *l, uint64_t k) {
  while (__atomic_load_n(&l->seq, __ATOMIC_ACQUIRE) < k) _mm_pause();
}

static uint64_t private_word;

// Lane message `k` from the other rank (its control line 0): taken, answered in our line 1
// (`answer`), then the locked step (`rmw`).
static void lane_take(rank_t *mine, rank_t *theirs, uint64_t k, int answer, int rmw) {
  wait_seq(&theirs->line[0], k);
  if (answer) __atomic_store_n(&mine->line[1].seq, k, __ATOMIC_RELEASE);
  if (rmw) __atomic_fetch_add(&private_word, 1, __ATOMIC_ACQ_REL);
}

// Lane message `k` sent (our control line 0), waiting for its answer with `answer`.
static void lane_give(rank_t *mine, rank_t *theirs, uint64_t k, int answer) {
  __atomic_store_n(&mine->line[0].seq, k, __ATOMIC_RELEASE);
  if (answer) wait_seq(&theirs->line[1], k);
}

// One run of `mode` by rank `me`; returns ns per step (rank 0's clock).
static double run(const char *mode, rank_t *r, int me) {
  rank_t *mine = &r[me], *theirs = &r[1 - me];
  float buf[SLOT / 4] __attribute__((aligned(64))), got = 0;
  for (int i = 0; i < SLOT / 4; i++) buf[i] = (float)i;
  int slots = !strncmp(mode, "slots", 5), nt = !strcmp(mode, "slots-nt"),
      claim = !strcmp(mode, "slots-claim"), stream = !strcmp(mode, "stream"),
      lane = !strncmp(mode, "lane", 4), answer = lane && strcmp(mode, "lane") != 0,
      rmw = !strcmp(mode, "lane-rmw");
  double t0 = 0;
  for (uint64_t k = 1; k <= STEPS + WARM; k++) {
    if (k == WARM + 1) t0 = now();
    if (lane) {
      if (me == 0) lane_give(mine, theirs, k, answer);
      lane_take(mine, theirs, k, answer, rmw);
      if (me == 1) lane_give(mine, theirs, k, answer);
      continue;
    }
    line_t *ml = &mine->line[k % LINES], *tl = &theirs->line[k % LINES];
    if (stream) {
      if (me == 0) {
        // Room to run ahead: the reader's position, read when it may have fallen LEAD behind.
        if (k > LEAD) wait_seq(&theirs->pos, k - LEAD);
        ml->data = k;
        __atomic_store_n(&ml->seq, k, __ATOMIC_RELEASE);
      } else {
        wait_seq(tl, k);
        got += (float)tl->data;
        if (k % (LEAD / 2) == 0) __atomic_store_n(&mine->pos.seq, k, __ATOMIC_RELEASE);
      }
      continue;
    }
    if (slots) {
      char *dst = mine->slot[k % 2];
      if (nt) {
        for (int o = 0; o < SLOT; o += 32)
          _mm256_stream_si256((__m256i *)(dst + o), _mm256_load_si256((__m256i *)((char *)buf + o)));
        _mm_sfence();
      } else {
        memcpy(dst, buf, SLOT);
      }
    } else {
      ml->data = k;
    }
    __atomic_store_n(&ml->seq, k, __ATOMIC_RELEASE);
    wait_seq(tl, k);
    if (slots) {
      const float *src = (const float *)theirs->slot[k % 2];
      for (int i = 0; i < SLOT / 4; i++) buf[i] += src[i];
      buf[0] = 0;
      if (claim)
        for (int o = 0; o < SLOT; o += 64) _m_prefetchw(mine->slot[(k + 1) % 2] + o);
    } else {
      got += (float)tl->data;
    }
  }
  if (got == -1) puts("");  // keep the reads
  // A lane step is a round trip: two messages.
  return (now() - t0) / (lane ? 2.0 * STEPS : STEPS);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  const char *all[] = {"exchange", "slots", "slots-nt",    "slots-claim",
                       "stream",   "lane",  "lane-answer", "lane-rmw"};
  const char **modes = argc > 1 ? (const char **)argv + 1 : all;
  int nmodes = argc > 1 ? argc - 1 : (int)(sizeof all / sizeof all[0]);
  for (int m = 0; m < nmodes; m++) {
    double t[5];
    for (int rep = 0; rep < 5; rep++) {
      rank_t *r = mmap(0, 2 * sizeof(rank_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
      if (r == MAP_FAILED) { perror("mmap"); return 1; }
      pid_t child = fork();
      if (child < 0) { perror("fork"); return 1; }
      double ns = run(modes[m], r, child == 0 ? 1 : 0);
      if (child == 0) _exit(0);
      waitpid(child, 0, 0);
      munmap(r, 2 * sizeof(rank_t));
      t[rep] = ns;
    }
    qsort(t, 5, sizeof t[0], cmp);
    printf("%-12s %7.1f ns/step (runs %.1f-%.1f)\n", modes[m], t[2], t[0], t[4]);
  }
  return 0;
}
