/* HTTP server tests (include/linmoe/server.h): a server in this process on a free
 * loopback port, over configs/tiny.json with non-trivial random weights, driven by a
 * small raw-socket HTTP/1.1 client (so malformed requests can be sent as they are):
 *  - endpoints: completions and chat, streamed (SSE) and not, logprobs, echo, stop
 *    strings, /v1/models, /health, /metrics, the chat page, 404 / 405;
 *  - security: oversized bodies (declared and chunked) and headers, deeply nested JSON,
 *    invalid UTF-8, wrong types, negative / huge max_tokens, prompts over the context,
 *    missing / wrong API key; the server answers each with the right status and stays
 *    up; it listens on 127.0.0.1 only by default;
 *  - faults: a client that disconnects mid-stream frees its row at once; a burst over
 *    the queue limit gets 429s while the accepted requests are answered correctly;
 *  - correctness: 50 prompts (5 families sharing a 150-token prefix) served under
 *    16-way concurrency with the prefix cache on, greedy and seeded sampling, each
 *    byte-identical to `linmoe generate` run alone with the same seed.
 */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "cli_util.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/server.h"
#include "model_util.h"
#include "test_util.h"

#ifndef LM_SOURCE_DIR
#define LM_SOURCE_DIR "."
#endif

/* ---------------------------------------------------------------- fixture */

typedef struct {
    lm_params p;
    lm_model *m;
    lm_tokenizer *tok;
    lm_server *s;
    int port;
} fix;

static lm_params g_p;
static int g_have_p;

static void fix_start(fix *f, const lm_server_config *c) {
    lm_error err = {0};
    if (!g_have_p) {
        lm_model_config cfg;
        lm_test_load_model_config(&cfg, LM_SOURCE_DIR "/configs/tiny.json");
        assert_int_equal(lm_params_init(&g_p, &cfg, &err), LM_OK);
        lm_test_randomize_params(&g_p, 23);
        /* also a checkpoint, for `linmoe generate` */
        assert_int_equal(lm_params_save(&g_p, lm_cli_path("ckpt"), &err), LM_OK);
        g_have_p = 1;
    }
    assert_int_equal(lm_tokenizer_byte(&f->tok, &err), LM_OK);
    assert_int_equal(lm_model_new(&f->m, &g_p, lm_engine_model_tokens(&c->engine), &err), LM_OK);
    lm_status st = lm_server_start(&f->s, f->m, f->tok, c, &err);
    if (st != LM_OK)
        fail_msg("%s", err.msg);
    f->port = lm_server_port(f->s);
    assert_true(f->port > 0);
}

static void fix_stop(fix *f) {
    lm_server_stop(f->s);
    lm_model_free(f->m);
    lm_tokenizer_free(f->tok);
}

static void base_config(lm_server_config *c) {
    lm_server_config_default(c);
    c->port = 0;
    c->engine.max_seqs = 16;
    c->engine.max_len = 512;
    c->engine.max_batch_tokens = 128;
    c->engine.state_cache_bytes = (int64_t)64 << 20;
    c->engine.max_queue = 256;
}

/* ---------------------------------------------------------------- HTTP client */

typedef struct {
    int status;
    char *body; /* de-chunked */
    size_t len;
    char head[4096];
} resp;

static void resp_free(resp *r) {
    free(r->body);
    r->body = NULL;
}

static int dial(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {30, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void send_all(int fd, const char *b, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        if (w <= 0)
            return; /* the server may close early (413): fine */
        b += w;
        n -= (size_t)w;
    }
}

/* Read the whole response (the server closes: requests say Connection: close). */
static void read_resp(int fd, resp *r) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 4096 > cap)
            buf = realloc(buf, cap *= 2);
        ssize_t g = recv(fd, buf + n, cap - n - 1, 0);
        if (g <= 0)
            break;
        n += (size_t)g;
    }
    buf[n] = '\0';
    r->status = 0;
    r->body = NULL;
    r->len = 0;
    r->head[0] = '\0';
    sscanf(buf, "HTTP/1.%*d %d", &r->status);
    char *e = strstr(buf, "\r\n\r\n");
    if (!e) {
        free(buf);
        r->body = calloc(1, 1);
        return;
    }
    size_t hl = (size_t)(e - buf);
    memcpy(r->head, buf, hl < sizeof r->head - 1 ? hl : sizeof r->head - 1);
    r->head[hl < sizeof r->head - 1 ? hl : sizeof r->head - 1] = '\0';
    const char *p = e + 4;
    r->body = malloc(n + 1);
    if (lm_contains_ci(r->head, "transfer-encoding: chunked")) {
        for (;;) {
            unsigned long sz = strtoul(p, NULL, 16);
            const char *q = strstr(p, "\r\n");
            if (!q || sz == 0)
                break;
            q += 2;
            if ((size_t)(q - buf) + sz > n)
                sz = n - (size_t)(q - buf);
            memcpy(r->body + r->len, q, sz);
            r->len += sz;
            p = q + sz + 2;
            if ((size_t)(p - buf) >= n)
                break;
        }
    } else {
        r->len = n - (size_t)(p - buf);
        memcpy(r->body, p, r->len);
    }
    r->body[r->len] = '\0';
    free(buf);
}

static void raw(int port, const char *req, size_t n, resp *r) {
    int fd = dial(port);
    assert_true(fd >= 0);
    send_all(fd, req, n);
    read_resp(fd, r);
    close(fd);
}

static void request(int port, const char *method, const char *path, const char *key,
                    const char *body, resp *r) {
    char *req = malloc(strlen(body ? body : "") + 1024);
    int n =
        sprintf(req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n", method, path);
    if (key)
        n += sprintf(req + n, "Authorization: Bearer %s\r\n", key);
    if (body)
        n += sprintf(req + n, "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    else
        n += sprintf(req + n, "\r\n");
    raw(port, req, (size_t)n, r);
    free(req);
}

static cJSON *post(int port, const char *path, const char *body, int want_status) {
    resp r;
    request(port, "POST", path, NULL, body, &r);
    if (r.status != want_status)
        fail_msg("POST %s %s: %d %s", path, body, r.status, r.body);
    cJSON *o = cJSON_Parse(r.body);
    if (!o)
        fail_msg("not JSON: %s", r.body);
    resp_free(&r);
    return o;
}

/* Error responses: the status, OpenAI's error object, and the param it names. */
static void expect_error(int port, const char *key, const char *body, int status,
                         const char *param) {
    resp r;
    request(port, "POST", "/v1/completions", key, body, &r);
    if (r.status != status)
        fail_msg("%.200s: status %d (want %d): %.300s", body, r.status, status, r.body);
    cJSON *o = cJSON_Parse(r.body);
    if (!o)
        fail_msg("%.200s: error body is not JSON: %.300s", body, r.body);
    const cJSON *e = cJSON_GetObjectItem(o, "error");
    assert_non_null(e);
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "message")));
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "type")));
    if (param) {
        const cJSON *pj = cJSON_GetObjectItem(e, "param");
        if (!cJSON_IsString(pj) || strcmp(pj->valuestring, param) != 0)
            fail_msg("%.200s: param %s (want %s)", body, cJSON_Print(pj), param);
    }
    cJSON_Delete(o);
    resp_free(&r);
}

static double metric(int port, const char *name) {
    resp r;
    request(port, "GET", "/metrics", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    double v = -1;
    char key[256];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(r.body, key);
    if (p)
        v = strtod(p + strlen(key), NULL);
    resp_free(&r);
    return v;
}

static const char *choice_text(cJSON *o) {
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    const cJSON *t = cJSON_GetObjectItem(c, "text");
    if (!t)
        t = cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content");
    assert_true(cJSON_IsString(t));
    return t->valuestring;
}

/* The text of an SSE stream (completions or chat chunks); asserts the framing. */
static char *sse_text(const char *body, cJSON **usage, char *finish, size_t fsize) {
    char *out = calloc(1, strlen(body) + 1);
    const char *p = body;
    int done = 0;
    while ((p = strstr(p, "data: ")) != NULL) {
        p += 6;
        const char *e = strstr(p, "\n\n");
        assert_non_null(e);
        if (strncmp(p, "[DONE]", 6) == 0) {
            done = 1;
            break;
        }
        cJSON *o = cJSON_ParseWithLength(p, (size_t)(e - p));
        if (!o)
            fail_msg("bad SSE chunk: %.*s", (int)(e - p), p);
        const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
        const cJSON *t = cJSON_GetObjectItem(c, "text");
        if (!t)
            t = cJSON_GetObjectItem(cJSON_GetObjectItem(c, "delta"), "content");
        if (cJSON_IsString(t))
            strcat(out, t->valuestring);
        const cJSON *fr = cJSON_GetObjectItem(c, "finish_reason");
        if (cJSON_IsString(fr)) {
            snprintf(finish, fsize, "%s", fr->valuestring);
            if (usage)
                *usage = cJSON_Duplicate(cJSON_GetObjectItem(o, "usage"), 1);
        }
        cJSON_Delete(o);
        p = e;
    }
    assert_true(done);
    return out;
}

/* ---------------------------------------------------------------- tests */

static void test_endpoints(void **state) {
    (void)state;
    lm_server_config c;
    base_config(&c);
    fix f;
    fix_start(&f, &c);
    resp r;
    request(f.port, "GET", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    request(f.port, "GET", "/v1/models", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"id\":\"linmoe\""));
    resp_free(&r);
    /* the chat page is the checked-in HTML */
    request(f.port, "GET", "/", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    assert_true(lm_contains_ci(r.head, "text/html"));
    FILE *hf = fopen(LM_SOURCE_DIR "/src/serve/chat_page.html", "rb");
    assert_non_null(hf);
    char *html = calloc(1, 1 << 20);
    const size_t hn = fread(html, 1, (1 << 20) - 1, hf);
    fclose(hf);
    assert_int_equal(r.len, hn);
    assert_memory_equal(r.body, html, hn);
    assert_null(strstr(html, "http://")); /* no external resources */
    assert_null(strstr(html, "https://"));
    free(html);
    resp_free(&r);
    request(f.port, "GET", "/v1/nope", NULL, NULL, &r);
    assert_int_equal(r.status, 404);
    assert_non_null(strstr(r.body, "\"error\""));
    resp_free(&r);
    request(f.port, "GET", "/v1/completions", NULL, NULL, &r);
    assert_int_equal(r.status, 405);
    resp_free(&r);

    /* greedy completion: usage, finish_reason; streamed = not streamed */
    const char *body = "{\"prompt\":\"The jury said\",\"max_tokens\":20,\"temperature\":0}";
    cJSON *o = post(f.port, "/v1/completions", body, 200);
    assert_string_equal(cJSON_GetObjectItem(o, "object")->valuestring, "text_completion");
    const char *text = choice_text(o);
    const cJSON *u = cJSON_GetObjectItem(o, "usage");
    assert_int_equal((int)cJSON_GetObjectItem(u, "prompt_tokens")->valuedouble, 14); /* eot + 13 */
    const int ct = (int)cJSON_GetObjectItem(u, "completion_tokens")->valuedouble;
    char fr[32];
    snprintf(fr, sizeof fr, "%s",
             cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0),
                                 "finish_reason")
                 ->valuestring);
    assert_true((ct == 20 && strcmp(fr, "length") == 0) || (ct < 20 && strcmp(fr, "stop") == 0));
    char *want = strdup(text);
    cJSON_Delete(o);
    request(f.port, "POST", "/v1/completions", NULL,
            "{\"prompt\":\"The jury said\",\"max_tokens\":20,\"temperature\":0,\"stream\":true}",
            &r);
    assert_int_equal(r.status, 200);
    assert_true(lm_contains_ci(r.head, "text/event-stream"));
    cJSON *su = NULL;
    char fin[32] = "";
    char *got = sse_text(r.body, &su, fin, sizeof fin);
    assert_string_equal(got, want);
    assert_string_equal(fin, fr);
    assert_non_null(su);
    assert_int_equal((int)cJSON_GetObjectItem(su, "completion_tokens")->valuedouble, ct);
    cJSON_Delete(su);
    free(got);
    resp_free(&r);
    /* a stop string taken from the greedy text cuts it there */
    const size_t wl = strlen(want);
    if (wl >= 6) {
        char stop[8], sb[512];
        memcpy(stop, want + wl / 2, 2);
        stop[2] = '\0';
        if (!strchr(stop, '"') && !strchr(stop, '\\') && (unsigned char)stop[0] < 0x80 &&
            (unsigned char)stop[1] < 0x80) {
            snprintf(sb, sizeof sb,
                     "{\"prompt\":\"The jury said\",\"max_tokens\":20,\"temperature\":0,"
                     "\"stop\":[\"%s\"]}",
                     stop);
            o = post(f.port, "/v1/completions", sb, 200);
            const char *cut = strstr(want, stop);
            assert_int_equal(strlen(choice_text(o)), (size_t)(cut - want));
            assert_memory_equal(choice_text(o), want, (size_t)(cut - want));
            cJSON_Delete(o);
        }
    }
    /* echo + logprobs */
    o = post(f.port, "/v1/completions",
             "{\"prompt\":\"The jury said\",\"max_tokens\":5,\"temperature\":0,\"echo\":true,"
             "\"logprobs\":3}",
             200);
    assert_memory_equal(choice_text(o), "The jury said", 13);
    const cJSON *lp =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "logprobs");
    const cJSON *tl = cJSON_GetObjectItem(lp, "token_logprobs");
    assert_true(cJSON_GetArraySize(tl) >= 1);
    for (const cJSON *x = tl->child; x; x = x->next)
        assert_true(x->valuedouble <= 0);
    assert_int_equal(
        cJSON_GetArraySize(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), 0)), 3);
    cJSON_Delete(o);
    /* chat, streamed and not: same text */
    const char *cb = "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":"
                     "\"user\",\"content\":\"Hello\"}],\"max_tokens\":12,\"temperature\":0%s}";
    char b1[512], b2[512];
    snprintf(b1, sizeof b1, cb, "");
    snprintf(b2, sizeof b2, cb, ",\"stream\":true");
    o = post(f.port, "/v1/chat/completions", b1, 200);
    assert_string_equal(cJSON_GetObjectItem(o, "object")->valuestring, "chat.completion");
    char *chat = strdup(choice_text(o));
    cJSON_Delete(o);
    request(f.port, "POST", "/v1/chat/completions", NULL, b2, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"role\":\"assistant\""));
    got = sse_text(r.body, NULL, fin, sizeof fin);
    assert_string_equal(got, chat);
    free(got);
    free(chat);
    resp_free(&r);
    /* the chat template */
    const char *roles[2] = {"system", "user"}, *conts[2] = {"Be brief.", "Hello"};
    char *t = lm_chat_template(roles, conts, 2);
    assert_string_equal(t, "System: Be brief.\n\nUser: Hello\n\nAssistant:");
    free(t);
    /* metrics */
    request(f.port, "GET", "/metrics", NULL, NULL, &r);
    const char *names[] = {"linmoe_requests_total{endpoint=\"/v1/completions\",status=\"200\"}",
                           "linmoe_prompt_tokens_total",
                           "linmoe_generation_tokens_total",
                           "linmoe_queue_depth",
                           "linmoe_running_sequences",
                           "linmoe_batch_size",
                           "linmoe_prefix_cache_hit_rate",
                           "linmoe_prefix_cache_hit_tokens_total",
                           "linmoe_time_to_first_token_seconds_bucket{le=\"+Inf\"}",
                           "linmoe_time_per_output_token_seconds_count"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!strstr(r.body, names[i]))
            fail_msg("/metrics lacks %s:\n%s", names[i], r.body);
    resp_free(&r);
    free(want);
    fix_stop(&f);
}

static void test_security(void **state) {
    (void)state;
    lm_server_config c;
    base_config(&c);
    c.max_body_bytes = 64 << 10;
    c.max_header_bytes = 16 << 10;
    fix f;
    fix_start(&f, &c);
    const int P = f.port;
    resp r;
    /* oversized body, declared */
    char *big = malloc(200 << 10);
    memset(big, 'a', 200 << 10);
    big[0] = '{';
    big[(200 << 10) - 1] = '\0';
    request(P, "POST", "/v1/completions", NULL, big, &r);
    assert_int_equal(r.status, 413);
    assert_non_null(strstr(r.body, "\"error\""));
    resp_free(&r);
    /* oversized body, chunked (no length) */
    {
        const char *h = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                        "Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n";
        size_t n = strlen(h);
        char *req = malloc(n + (100 << 10) + 64);
        memcpy(req, h, n);
        n += (size_t)sprintf(req + n, "%x\r\n", 90 << 10);
        memset(req + n, 'a', 90 << 10);
        n += 90 << 10;
        memcpy(req + n, "\r\n0\r\n\r\n", 7);
        n += 7;
        raw(P, req, n, &r);
        assert_int_equal(r.status, 413);
        resp_free(&r);
        free(req);
    }
    /* oversized headers */
    {
        char *req = malloc(64 << 10);
        int n = sprintf(req, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ");
        memset(req + n, 'b', 40 << 10);
        n += 40 << 10;
        n += sprintf(req + n, "\r\nConnection: close\r\n\r\n");
        raw(P, req, (size_t)n, &r);
        assert_true(r.status == 431 || r.status == 413);
        resp_free(&r);
        free(req);
    }
    free(big);
    /* nested JSON */
    {
        char deep[4200];
        int n = sprintf(deep, "{\"prompt\":\"a\",\"x\":");
        for (int i = 0; i < 2000; i++)
            deep[n++] = '[';
        for (int i = 0; i < 2000; i++)
            deep[n++] = ']';
        deep[n++] = '}';
        deep[n] = '\0';
        expect_error(P, NULL, deep, 400, NULL);
    }
    /* invalid UTF-8: a raw 0xFF, an overlong '/', a surrogate, a truncated sequence */
    expect_error(P, NULL, "{\"prompt\":\"a\xff\"}", 400, NULL);
    expect_error(P, NULL, "{\"prompt\":\"a\xc0\xaf\"}", 400, NULL);
    expect_error(P, NULL, "{\"prompt\":\"a\xed\xa0\x80\"}", 400, NULL);
    expect_error(P, NULL, "{\"prompt\":\"a\xe2\x82\"}", 400, NULL);
    expect_error(P, NULL, "{\"prompt\":\"a\\ud800\"}", 400, NULL); /* lone surrogate escape */
    /* max_tokens */
    expect_error(P, NULL, "{\"prompt\":\"a\",\"max_tokens\":-1}", 400, "max_tokens");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"max_tokens\":1000000000000}", 400, "max_tokens");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"max_tokens\":1e308}", 400, "max_tokens");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"max_tokens\":2.5}", 400, "max_tokens");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"max_tokens\":\"7\"}", 400, "max_tokens");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"max_tokens\":511}", 400, "max_tokens");
    /* types and values */
    expect_error(P, NULL, "{\"prompt\":12}", 400, "prompt");
    expect_error(P, NULL, "{\"prompt\":[1,2,300]}", 400, "prompt");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"temperature\":\"hot\"}", 400, "temperature");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"temperature\":-1}", 400, "temperature");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"top_p\":0}", 400, "top_p");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"stream\":1}", 400, "stream");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"stop\":[1]}", 400, "stop");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"n\":2}", 400, "n");
    expect_error(P, NULL, "{\"prompt\":\"a\",\"logprobs\":100}", 400, "logprobs");
    expect_error(P, NULL, "[1,2]", 400, NULL);
    expect_error(P, NULL, "{\"prompt\":", 400, NULL);
    expect_error(P, NULL, "", 400, NULL);
    /* a prompt over the context: 413 */
    {
        char *lp = malloc(2000);
        int n = sprintf(lp, "{\"prompt\":\"");
        for (int i = 0; i < 600; i++)
            lp[n++] = 'x';
        sprintf(lp + n, "\"}");
        expect_error(P, NULL, lp, 413, "prompt");
        free(lp);
    }
    request(P, "POST", "/v1/chat/completions", NULL,
            "{\"messages\":[{\"role\":\"x\",\"content\":\"a\"}]}", &r);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "messages[0].role"));
    resp_free(&r);
    request(P, "GET", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200); /* still up */
    resp_free(&r);
    /* default: loopback only. Connecting to another local address fails. */
    lm_server_config d;
    lm_server_config_default(&d);
    assert_string_equal(d.host, "127.0.0.1");
    struct ifaddrs *ifs = NULL;
    int tried = 0;
    if (getifaddrs(&ifs) == 0) {
        for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET)
                continue;
            struct sockaddr_in a = *(struct sockaddr_in *)i->ifa_addr;
            if ((ntohl(a.sin_addr.s_addr) >> 24) == 127)
                continue;
            a.sin_port = htons((uint16_t)P);
            int fd = socket(AF_INET, SOCK_STREAM, 0);
            assert_true(connect(fd, (struct sockaddr *)&a, sizeof a) != 0);
            close(fd);
            tried++;
        }
        freeifaddrs(ifs);
    }
    printf("security: every bad request refused with its status; not reachable on %d "
           "non-loopback address(es)\n",
           tried);
    fix_stop(&f);

    /* API key */
    base_config(&c);
    c.api_key = "s3cret-key";
    fix_start(&f, &c);
    request(f.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"a\",\"max_tokens\":2}", &r);
    assert_int_equal(r.status, 401);
    assert_non_null(strstr(r.body, "invalid_api_key"));
    resp_free(&r);
    request(f.port, "POST", "/v1/completions", "wrong", "{\"prompt\":\"a\",\"max_tokens\":2}", &r);
    assert_int_equal(r.status, 401);
    resp_free(&r);
    request(f.port, "GET", "/v1/models", NULL, NULL, &r);
    assert_int_equal(r.status, 401);
    resp_free(&r);
    request(f.port, "GET", "/metrics", "s3cret-ke", NULL, &r);
    assert_int_equal(r.status, 401);
    resp_free(&r);
    request(f.port, "POST", "/v1/completions", "s3cret-key", "{\"prompt\":\"a\",\"max_tokens\":2}",
            &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    request(f.port, "GET", "/", NULL, NULL, &r);
    assert_int_equal(r.status, 200); /* the page itself; it asks for the key */
    resp_free(&r);
    fix_stop(&f);
}

/* ---------------------------------------------------------------- faults */

typedef struct {
    int port;
    const char *body;
    int status;
    char *text;
} call;

static void *call_thread(void *arg) {
    call *c = arg;
    resp r;
    request(c->port, "POST", "/v1/completions", NULL, c->body, &r);
    c->status = r.status;
    c->text = NULL;
    if (r.status == 200) {
        cJSON *o = cJSON_Parse(r.body);
        if (o) {
            c->text = strdup(choice_text(o));
            cJSON_Delete(o);
        }
    }
    resp_free(&r);
    return NULL;
}

static void test_faults(void **state) {
    (void)state;
    lm_server_config c;
    base_config(&c);
    c.engine.max_seqs = 2;
    c.engine.max_queue = 2;
    c.engine.max_len = 4096;
    fix f;
    fix_start(&f, &c);
    /* 4000 tokens (ignore_eos: <|endoftext|> does not end it), far more than the test
     * takes to read a first chunk and hang up */
    const char *body = "{\"prompt\":\"A long one\",\"max_tokens\":4000,\"ignore_eos\":true,"
                       "\"stream\":true}";
    const double gen0 = metric(f.port, "linmoe_generation_tokens_total");
    /* a streaming client that goes away: its row is free at once */
    int fd = dial(f.port);
    char req[512];
    int n = sprintf(req,
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: %zu\r\n\r\n%s",
                    strlen(body), body);
    send_all(fd, req, (size_t)n);
    char buf[8192];
    size_t got = 0;
    while (got < sizeof buf - 1) { /* the headers, then a first chunk */
        const ssize_t g = recv(fd, buf + got, sizeof buf - 1 - got, 0);
        assert_true(g > 0);
        got += (size_t)g;
        buf[got] = '\0';
        if (strstr(buf, "data: "))
            break;
    }
    /* the gauges are a snapshot after each scheduler step: the step that drew the first
     * token may still be finishing */
    const double tr = lm_time_sec();
    while (metric(f.port, "linmoe_running_sequences") < 1) {
        assert_true(lm_time_sec() - tr < 0.5);
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    close(fd);
    const double t0 = lm_time_sec();
    while (metric(f.port, "linmoe_running_sequences") > 0) {
        assert_true(lm_time_sec() - t0 < 2.0);
        nanosleep(&(struct timespec){0, 5000000}, NULL);
    }
    const double freed = lm_time_sec() - t0;
    const double gen = metric(f.port, "linmoe_generation_tokens_total") - gen0;
    assert_true(gen >= 1 && gen < 4000); /* cancelled, not run to the end */
    /* the reference answer, alone */
    const char *rb = "{\"prompt\":\"Burst\",\"max_tokens\":40,\"temperature\":0}";
    cJSON *o = post(f.port, "/v1/completions", rb, 200);
    char *want = strdup(choice_text(o));
    cJSON_Delete(o);
    /* a burst of 12 over 2 rows + a queue of 2 */
    enum { NB = 12 };
    call calls[NB];
    pthread_t th[NB];
    for (int i = 0; i < NB; i++) {
        calls[i] = (call){f.port, rb, 0, NULL};
        pthread_create(&th[i], NULL, call_thread, &calls[i]);
    }
    int ok = 0, busy = 0;
    for (int i = 0; i < NB; i++) {
        pthread_join(th[i], NULL);
        if (calls[i].status == 200) {
            ok++;
            assert_string_equal(calls[i].text, want);
        } else {
            assert_int_equal(calls[i].status, 429);
            busy++;
        }
        free(calls[i].text);
    }
    printf("faults: a disconnected stream freed its row in %.0f ms (%g tokens generated of "
           "4000); burst of %d over 2 rows + queue 2: %d answered (all equal to the request "
           "alone), %d refused with 429\n",
           freed * 1e3, gen, NB, ok, busy);
    assert_true(ok >= 2);
    assert_true(busy >= 1);
    free(want);
    fix_stop(&f);
}

/* ---------------------------------------------------------------- vs generate */

enum { NP = 50, GEN = 24 };

typedef struct {
    int port;
    int i0, i1;
    char **prompts;
    char **served;
    size_t *served_len;
} batch_arg;

static void body_for(int i, const char *prompt, char *b, size_t n) {
    if (i % 2 == 0)
        snprintf(b, n, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0}", prompt, GEN);
    else
        snprintf(b, n,
                 "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0.9,\"top_p\":0.95,"
                 "\"top_k\":40,\"seed\":%d}",
                 prompt, GEN, 1000 + i);
}

/* The "text" of a completion response with its length (it may hold U+0000, which cJSON
 * strings cannot): the JSON string unescaped by hand (the escapes cJSON prints). */
static char *json_text(const char *body, size_t *len) {
    const char *p = strstr(body, "\"text\":\"");
    assert_non_null(p);
    p += 8;
    char *o = malloc(strlen(p) + 1);
    size_t k = 0;
    while (*p && *p != '"') {
        if (*p != '\\') {
            o[k++] = *p++;
            continue;
        }
        p++;
        const char c = *p++;
        if (c == 'n')
            o[k++] = '\n';
        else if (c == 't')
            o[k++] = '\t';
        else if (c == 'r')
            o[k++] = '\r';
        else if (c == 'b')
            o[k++] = '\b';
        else if (c == 'f')
            o[k++] = '\f';
        else if (c == 'u') {
            unsigned v = (unsigned)strtoul((char[5]){p[0], p[1], p[2], p[3], 0}, NULL, 16);
            p += 4;
            assert_true(v < 0x80); /* cJSON escapes control characters only */
            o[k++] = (char)v;
        } else
            o[k++] = c;
    }
    o[k] = '\0';
    *len = k;
    return o;
}

/* `linmoe generate ARGS` stdout and stderr, with the length. */
static char *run_generate(const char *args, size_t *len) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' generate %s 2>&1", getenv("LINMOE_BIN"), args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap);
    size_t g;
    while ((g = fread(b + n, 1, cap - n - 1, p)) > 0)
        n += g;
    b[n] = '\0';
    assert_int_equal(pclose(p), 0);
    *len = n;
    return b;
}

static void *batch_thread(void *arg) {
    batch_arg *a = arg;
    for (int i = a->i0; i < a->i1; i++) {
        char b[2048];
        body_for(i, a->prompts[i], b, sizeof b);
        resp r;
        request(a->port, "POST", "/v1/completions", NULL, b, &r);
        if (r.status == 200)
            a->served[i] = json_text(r.body, &a->served_len[i]);
        resp_free(&r);
    }
    return NULL;
}

/* generate's raw bytes with invalid UTF-8 and NUL replaced by U+FFFD, as the server sends
 * them */
static char *sanitize(const char *s, size_t n, size_t *out_len) {
    char *o = malloc(3 * n + 1);
    size_t k = 0, i = 0;
    while (i < n) {
        const int64_t bad = lm_utf8_invalid_at(s + i, n - i);
        size_t good = bad < 0 ? n - i : (size_t)bad;
        const char *z = memchr(s + i, '\0', good);
        if (z)
            good = (size_t)(z - (s + i));
        memcpy(o + k, s + i, good);
        k += good;
        i += good;
        if (i < n) {
            memcpy(o + k, "\xEF\xBF\xBD", 3);
            k += 3;
            i++;
        }
    }
    o[k] = '\0';
    *out_len = k;
    return o;
}

static void test_vs_generate(void **state) {
    (void)state;
    lm_server_config c;
    base_config(&c);
    c.engine.block_tokens = 64; /* `linmoe generate`'s blocks */
    fix f;
    fix_start(&f, &c);
    char *prompts[NP], *served[NP];
    size_t served_len[NP];
    const char *fam[5] = {"The committee said that the city", "In the beginning of the year, the",
                          "Mr. Smith went to Washington and", "A new study of the river shows",
                          "She asked whether the old house"};
    uint64_t rs = 5;
    for (int i = 0; i < NP; i++) {
        prompts[i] = malloc(512);
        served[i] = NULL;
        /* a shared 150-byte family prefix (two cache blocks), then a tail of 0-60 bytes */
        int n = 0;
        while (n < 150)
            n += sprintf(prompts[i] + n, "%s ", fam[i % 5]);
        n = 150;
        rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
        const int tail = (int)((rs >> 33) % 61);
        for (int k = 0; k < tail; k++)
            prompts[i][n++] = (char)('a' + (k * 7 + i) % 26);
        prompts[i][n] = '\0';
    }
    /* 16 clients at once */
    enum { NT = 16 };
    pthread_t th[NT];
    batch_arg args[NT];
    for (int t = 0; t < NT; t++) {
        args[t] = (batch_arg){f.port, t * NP / NT, (t + 1) * NP / NT, prompts, served, served_len};
        pthread_create(&th[t], NULL, batch_thread, &args[t]);
    }
    for (int t = 0; t < NT; t++)
        pthread_join(th[t], NULL);
    const double hits = metric(f.port, "linmoe_prefix_cache_hits_total");
    const double hit_tok = metric(f.port, "linmoe_prefix_cache_hit_tokens_total");
    fix_stop(&f);
    int same = 0;
    for (int i = 0; i < NP; i++) {
        assert_non_null(served[i]);
        FILE *pf = fopen(lm_cli_path("prompt.txt"), "wb");
        fputs(prompts[i], pf);
        fclose(pf);
        char args[2048];
        if (i % 2 == 0)
            snprintf(args, sizeof args,
                     "--ckpt '%s' --prompt-file '%s' --max-new %d --temperature 0 --threads 2",
                     lm_cli_path("ckpt"), lm_cli_path("prompt.txt"), GEN);
        else
            snprintf(args, sizeof args,
                     "--ckpt '%s' --prompt-file '%s' --max-new %d --temperature 0.9 --top-p 0.95 "
                     "--top-k 40 --seed %d --threads 2",
                     lm_cli_path("ckpt"), lm_cli_path("prompt.txt"), GEN, 1000 + i);
        size_t on = 0;
        char *out = run_generate(args, &on);
        /* stdout: prompt, continuation, "\n"; then the summary from stderr */
        const char *mark = "\nlinmoe generate: prompt";
        char *sum = NULL;
        for (size_t k = 0; k + strlen(mark) <= on; k++)
            if (memcmp(out + k, mark, strlen(mark)) == 0)
                sum = out + k;
        assert_non_null(sum);
        const size_t pl = strlen(prompts[i]);
        assert_memory_equal(out, prompts[i], pl);
        size_t gl = 0;
        char *g = sanitize(out + pl, (size_t)(sum - out) - pl, &gl);
        if (gl != served_len[i] || memcmp(g, served[i], gl) != 0)
            fail_msg("prompt %d (%s): served %zu bytes '%s', generate %zu bytes '%s'", i,
                     i % 2 ? "sampled" : "greedy", served_len[i], served[i], gl, g);
        free(out);
        same++;
        free(g);
        free(served[i]);
        free(prompts[i]);
    }
    printf("vs generate: %d of %d completions (greedy and seeded sampling, 16 clients at once, "
           "prefix cache on: %g hits, %g tokens restored) identical to `linmoe generate` alone\n",
           same, NP, hits, hit_tok);
    assert_int_equal(same, NP);
    assert_true(hits >= 10);
}

/* The scheduler thread runs the model on the caller's lm_set_num_threads count (or
 * config.threads), not on OpenMP's default for a new thread (every core). */
static int model_threads(int port) {
    double v = 0;
    for (int i = 0; i < 200 && v <= 0; i++) { /* the scheduler thread sets it on start */
        v = metric(port, "linmoe_model_threads");
        if (v <= 0)
            nanosleep(&(struct timespec){0, 5000000}, NULL);
    }
    return (int)v;
}

static void test_threads(void **state) {
    (void)state;
    const int def = lm_get_num_threads();
    lm_server_config c;
    base_config(&c);
    fix f;
    for (int want = 1; want <= 2; want++) {
        lm_set_num_threads(want); /* the caller's count, c.threads = 0 */
        fix_start(&f, &c);
        assert_int_equal(model_threads(f.port), want);
        fix_stop(&f);
    }
    lm_set_num_threads(2);
    c.threads = 1; /* an explicit count wins */
    fix_start(&f, &c);
    assert_int_equal(model_threads(f.port), 1);
    fix_stop(&f);
    lm_set_num_threads(def);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_endpoints),   cmocka_unit_test(test_threads),
        cmocka_unit_test(test_security),    cmocka_unit_test(test_faults),
        cmocka_unit_test(test_vs_generate),
    };
    int rc = cmocka_run_group_tests(tests, lm_cli_setup_dir, lm_cli_teardown_dir);
    if (g_have_p)
        lm_params_free(&g_p);
    return rc;
}
