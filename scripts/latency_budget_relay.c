/* One relay of scripts/latency_budget.py's model, in C: the same frames and the same W us of
 * work per frame as the script's pyzmq relay (`_relay`), so that the two side by side say
 * what Python costs around libzmq and what a relay written natively would start from.
 *
 *   latency_budget_relay ID CLIENT_PORT PUB0 PUB1 PUB2 WORK_US FREE_PEER_REPORTS
 *
 * Built by the script with gcc against the libzmq that pyzmq loads (the script passes the
 * socket-type and option numbers as -D definitions from pyzmq, so no zmq.h is needed).
 * Says "ready" on stdout once bound, connected and subscribed; runs until terminated. */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>

typedef struct {
    void *socket;
    int fd;
    short events;
    short revents;
} zmq_pollitem_t;

void *zmq_ctx_new(void);
void *zmq_socket(void *context, int type);
int zmq_bind(void *socket, const char *endpoint);
int zmq_connect(void *socket, const char *endpoint);
int zmq_setsockopt(void *socket, int option, const void *value, size_t length);
int zmq_poll(zmq_pollitem_t *items, int count, long timeout_ms);
int zmq_recv(void *socket, void *buffer, size_t length, int flags);
int zmq_send(void *socket, const void *buffer, size_t length, int flags);

enum { MEMBERS = 3, SEQ_BYTES = 8, FRAME_MAX_BYTES = 65536, IDENTITY_MAX_BYTES = 256 };
#define CONNECT_SETTLE_US 300000 /* as CONNECT_SETTLE_S: subscriptions reach the PUBs */
#define BATCH 'B'
#define REPORT 'R'

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* Busy work standing for the protocol's per-frame work (a sleep would free the core). */
static void spin(double work_us) {
    if (work_us <= 0)
        return;
    double end = now_us() + work_us;
    while (now_us() < end) {
    }
}

static void endpoint(char *out, size_t size, int port) {
    snprintf(out, size, "tcp://127.0.0.1:%d", port);
}

static void fail(const char *what) {
    fprintf(stderr, "latency_budget_relay: %s failed\n", what);
    exit(3);
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s ID CLIENT_PORT PUB0 PUB1 PUB2 WORK_US FREE_PEER_REPORTS\n",
                argv[0]);
        return 2;
    }
    prctl(PR_SET_PDEATHSIG, SIGTERM); /* follow the script out if it dies */
    int id = atoi(argv[1]), client_port = atoi(argv[2]);
    int pub_ports[MEMBERS] = {atoi(argv[3]), atoi(argv[4]), atoi(argv[5])};
    double work_us = atof(argv[6]);
    int free_peer_reports = atoi(argv[7]);
    char where[64];

    void *ctx = zmq_ctx_new();
    void *pub = zmq_socket(ctx, ZMQ_PUB);
    endpoint(where, sizeof where, pub_ports[id]);
    if (zmq_bind(pub, where) != 0)
        fail("bind of the PUB");
    zmq_pollitem_t items[MEMBERS];
    int count = 0;
    for (int peer = 0; peer < MEMBERS; peer++) {
        if (peer == id)
            continue;
        void *sub = zmq_socket(ctx, ZMQ_SUB);
        zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0);
        endpoint(where, sizeof where, pub_ports[peer]);
        if (zmq_connect(sub, where) != 0)
            fail("connect of a SUB");
        items[count++] = (zmq_pollitem_t){sub, 0, ZMQ_POLLIN, 0};
    }
    void *router = NULL;
    if (id == 0) {
        router = zmq_socket(ctx, ZMQ_ROUTER);
        endpoint(where, sizeof where, client_port);
        if (zmq_bind(router, where) != 0)
            fail("bind of the ROUTER");
        items[count++] = (zmq_pollitem_t){router, 0, ZMQ_POLLIN, 0};
    }
    usleep(CONNECT_SETTLE_US);
    printf("ready\n");
    fflush(stdout);

    static char frame[FRAME_MAX_BYTES];
    char identity[IDENTITY_MAX_BYTES];
    int identity_bytes = 0;
    unsigned long long seq = 0, waiting = 0; /* the coordinator's request in flight */
    for (;;) {
        if (zmq_poll(items, count, -1) < 0)
            continue; /* EINTR */
        for (int i = 0; i < count; i++) {
            if (!(items[i].revents & ZMQ_POLLIN))
                continue;
            void *sock = items[i].socket;
            for (;;) { /* every message waiting, as the relays drain a socket */
                if (sock == router) {
                    int n = zmq_recv(router, identity, sizeof identity, ZMQ_DONTWAIT);
                    if (n < 0)
                        break;
                    identity_bytes = n;
                    n = zmq_recv(router, frame + 1 + SEQ_BYTES,
                                 sizeof frame - 1 - SEQ_BYTES, 0);
                    if (n < 0)
                        break;
                    spin(work_us);
                    seq++;
                    waiting = seq;
                    frame[0] = BATCH;
                    memcpy(frame + 1, &seq, SEQ_BYTES);
                    zmq_send(pub, frame, 1 + SEQ_BYTES + n, 0);
                    continue;
                }
                int n = zmq_recv(sock, frame, sizeof frame, ZMQ_DONTWAIT);
                if (n < 1 + SEQ_BYTES)
                    break;
                unsigned long long key;
                memcpy(&key, frame + 1, SEQ_BYTES);
                if (id == 0 || frame[0] == BATCH || !free_peer_reports)
                    spin(work_us);
                if (frame[0] == BATCH && id != 0) {
                    frame[0] = REPORT;
                    zmq_send(pub, frame, 1 + SEQ_BYTES, 0);
                } else if (frame[0] == REPORT && router != NULL && key == waiting) {
                    waiting = 0;
                    zmq_send(router, identity, identity_bytes, ZMQ_SNDMORE);
                    zmq_send(router, "ok", 2, 0);
                }
            }
        }
    }
}
