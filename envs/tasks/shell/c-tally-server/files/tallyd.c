/* tallyd: a tiny TCP counter server.  Counters live in memory only.
 *
 *   tallyd PORT          listens on 127.0.0.1:PORT
 *
 * One request per connection, one line each:
 *   ADD <name> <integer>   -> "OK <new value>"
 *   GET <name>             -> "<value>" (0 if unknown)
 *   DUMP                   -> "<name> <value>" lines, sorted by name, then "END"
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_COUNTERS 256

struct counter {
    char name[64];
    long long value;
};

static struct counter counters[MAX_COUNTERS];
static int ncounters;

static struct counter *find(const char *name, int create) {
    for (int i = 0; i < ncounters; i++)
        if (strcmp(counters[i].name, name) == 0)
            return &counters[i];
    if (!create || ncounters == MAX_COUNTERS)
        return NULL;
    struct counter *c = &counters[ncounters++];
    snprintf(c->name, sizeof c->name, "%s", name);
    c->value = 0;
    return c;
}

static int cmp(const void *a, const void *b) {
    return strcmp(((const struct counter *)a)->name, ((const struct counter *)b)->name);
}

static void handle(int fd) {
    char line[256];
    size_t n = 0;
    while (n < sizeof line - 1) {
        ssize_t r = read(fd, line + n, 1);
        if (r <= 0 || line[n] == '\n')
            break;
        n++;
    }
    line[n] = '\0';
    char out[256 * 80];
    char name[64];
    long long v;
    if (sscanf(line, "ADD %63s %lld", name, &v) == 2) {
        struct counter *c = find(name, 1);
        if (c) {
            c->value += v;
            snprintf(out, sizeof out, "OK %lld\n", c->value);
        } else {
            snprintf(out, sizeof out, "ERR full\n");
        }
    } else if (sscanf(line, "GET %63s", name) == 1) {
        struct counter *c = find(name, 0);
        snprintf(out, sizeof out, "%lld\n", c ? c->value : 0);
    } else if (strncmp(line, "DUMP", 4) == 0) {
        size_t len = 0;
        qsort(counters, ncounters, sizeof counters[0], cmp);
        for (int i = 0; i < ncounters; i++)
            len += snprintf(out + len, sizeof out - len, "%s %lld\n", counters[i].name, counters[i].value);
        snprintf(out + len, sizeof out - len, "END\n");
    } else {
        snprintf(out, sizeof out, "ERR bad request\n");
    }
    size_t off = 0, total = strlen(out);
    while (off < total) {
        ssize_t w = write(fd, out + off, total - off);
        if (w <= 0)
            break;
        off += w;
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s PORT\n", argv[0]);
        return 2;
    }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(atoi(argv[1]));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(s, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(s, 16) < 0) {
        perror("tallyd");
        return 1;
    }
    fprintf(stderr, "tallyd listening on 127.0.0.1:%s\n", argv[1]);
    for (;;) {
        int c = accept(s, NULL, NULL);
        if (c < 0)
            continue;
        handle(c);
        close(c);
    }
}
