/*
 * dsv4d_staged: the daemon with the CPU backend behind device staging (cpu_staged.c) standing in
 * for backend = cpu, so the integration suite runs through the engine's staging path without a
 * device. Never installed.
 */
#include "backend.h"
#include "cpu_staged.h"
#include "startup.h"

int main(int argc, char **argv) {
  if (dsv4_backend_register("cpu_staged", dsv4_test_cpu_staged_open) == 0)
    dsv4d_backend_alias("cpu", "cpu_staged");
  return dsv4d_run(argc, argv);
}
