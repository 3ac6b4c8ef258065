/*
 * dsv4d_staged: the daemon with the CPU backend behind device staging (cpu_staged.c) standing in
 * for backend = cpu, so the integration suite runs through the engine's staging path without a
 * device. Never installed.
 */
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu_staged.h"
#include "startup.h"

int main(int argc, char **argv) {
  /* DSV4_TEST_STAGED_OVERLAP=1: the staged backend in overlap mode (DSV4_BE_OVERLAP), so the
   * executor begins a batch while the one before is in flight. */
  const char *ov = getenv("DSV4_TEST_STAGED_OVERLAP");
  if (ov && !strcmp(ov, "1")) {
    if (dsv4_backend_register("cpu_staged_overlap", dsv4_test_cpu_staged_overlap_open) == 0)
      dsv4d_backend_alias("cpu", "cpu_staged_overlap");
  } else if (dsv4_backend_register("cpu_staged", dsv4_test_cpu_staged_open) == 0) {
    dsv4d_backend_alias("cpu", "cpu_staged");
  }
  return dsv4d_run(argc, argv);
}
