#include "sdnotify.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "dsv4-error.h"

int dsv4_sd_notify(const char *state) {
  const char *path = getenv("NOTIFY_SOCKET");
  struct sockaddr_un sa;
  size_t len;
  int fd, rc = 0;
  if (!path || !*path)
    return 0;
  len = strlen(path);
  if ((path[0] != '/' && path[0] != '@') || len >= sizeof(sa.sun_path))
    return DSV4_EIO;
  memset(&sa, 0, sizeof(sa));
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path, path, len);
  if (path[0] == '@')
    sa.sun_path[0] = '\0'; /* the abstract namespace */
  fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return DSV4_EIO;
  if (sendto(fd, state, strlen(state), MSG_NOSIGNAL, (const struct sockaddr *)&sa,
             (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) < 0)
    rc = DSV4_EIO;
  close(fd);
  return rc;
}
