/* The C kernels' thread team (team.c): team_run runs job(arg, tid, nt) on nt threads, the caller being
 * tid 0, and returns the team size it used (1 when nt <= 1 or another job holds the team); inside a job,
 * team_barrier(nt) waits for all nt threads. */
#ifndef SINKSERVE_TEAM_H
#define SINKSERVE_TEAM_H

typedef void (*team_job)(void *arg, int tid, int nt);

int team_run(team_job job, void *arg, int nt);
void team_barrier(int nt);

#endif
