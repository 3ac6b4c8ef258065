#ifndef DSV4_TESTS_CPU_STAGED_H
#define DSV4_TESTS_CPU_STAGED_H

/*
 * Test-only backend "cpu_staged": the CPU backend behind the interface of a device backend. It
 * reports no DSV4_BE_HOST_MEMORY, keeps every buffer in an allocation of its own and hands out
 * addresses that are not host addresses (dereferencing one faults), so the engine can only reach
 * the bytes through upload/download, and a launch whose argument points anywhere but into one of
 * its buffers is refused with DSV4_EINVAL. The bytes it computes are the CPU backend's. It offers
 * the fused decode path (DSV4_BE_ATTN_FUSED_Q) as the CUDA backend does, computing the raw q's
 * q_out itself before the CPU backend's attention, so the engine's fused path runs without a
 * device.
 *
 * Never built into the daemon that is installed: tests link it, and the test daemon dsv4d_staged
 * opens it for backend = cpu.
 */

#include <stddef.h>

#include "backend.h"

int dsv4_test_cpu_staged_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                              size_t why_len);
/*
 * "cpu_staged_overlap": the same with DSV4_BE_OVERLAP. The launches still run at submission; a
 * download_async of a batch's DOWNLOADS phase reads its source only when the batch is waited for
 * (batch_wait or sync), the latest moment backend.h allows, so an engine that lets a later batch
 * write a staging buffer before an earlier batch's wait answers the later batch's bytes. A third
 * batch submitted before the first was waited for, or a wait out of order, aborts.
 */
/* With DSV4_TEST_STAGED_STATS set, the overlap mode's close appends "overlapped N" to that file. */
int dsv4_test_cpu_staged_overlap_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out,
                                      char *why, size_t why_len);

/*
 * Counters of the staged backend be (for tests that check the engine staged what it should). The
 * backend has a host_register hook, as CUDA's: it keeps the ranges (one may not overlap another;
 * unregistering a pointer that starts none aborts) and counts the copies from and to them. Its
 * host_alias, as CUDA's, maps aligned registered memory at a made-up device window of its own,
 * which its launches translate back (DSV4_CUDA_NO_ALIAS=1 turns it off, as on CUDA). What an
 * insert writes there (q_out in place) reaches host memory only at the batch's sync or wait, as a
 * device's would; until then it holds the poison of a pending download_async. What a launch reads
 * there must hold the same bytes at the batch's sync or wait (a device may read it until then):
 * a caller that changed it earlier aborts the test there (cpu_staged_test).
 */
typedef struct {
  size_t uploads, downloads, launches, syncs;
  /* download_async calls: the copy is made at the next sync, and dst holds 0xa5 bytes until then,
   * so a caller that reads it before the sync computes with those. */
  size_t async_downloads;
  size_t batch_waits; /* overlap mode: batch_wait calls */
  size_t overlapped;  /* overlap mode: batches submitted while another was in flight */
  size_t live_buffers;
  size_t live_registrations;                       /* host ranges registered now */
  size_t registered_uploads, registered_downloads; /* copies whose host side lies in one */
  size_t aliases; /* host_alias calls answered with an address (launches then reach host memory) */
  /* attention launches, and those that came with the engine's windows (backend.h), each checked
   * against dsv4_attn_windows of the launch's tables (a difference refuses the launch) */
  size_t attn_launches, windows;
  /* marks (backend.h); marked downloads, and those of them that asked for bytes the launches
   * before their mark had not all written (or a launch after it wrote too): a device could copy
   * them before they are written, so they deliver 0xa5 bytes */
  size_t marks, marked_downloads, early_marked;
  /* indexer launches, and those of them in fast mode (dsv4_indexer_args_t.fast; the CPU selects
   * as in exact mode either way) */
  size_t indexer_launches, fast_indexer_launches;
} dsv4_test_cpu_staged_stats_t;

void dsv4_test_cpu_staged_stats(dsv4_backend_t *be, dsv4_test_cpu_staged_stats_t *out);

/* 1 (after printing "skipped: ..." on stdout) when backend name opens with DSV4_ENODEV: a test of a
 * device backend on a machine without that device then exits 77. */
int dsv4_test_backend_absent(const char *name);

/*
 * The start of a test that runs against the backend named by argv[1] (else *backend stays as it
 * is): registers cpu_staged, then returns 0 to run the tests, 77 when that backend's device is
 * absent, or 1 when the registration failed.
 */
int dsv4_test_backend_from_args(int argc, char **argv, const char **backend);

#endif /* DSV4_TESTS_CPU_STAGED_H */
