/* dsv4d: serves DeepSeek V4 attention layers over HTTP (README.md). */
#include "startup.h"

int main(int argc, char **argv) {
  return dsv4d_run(argc, argv);
}
