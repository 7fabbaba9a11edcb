/* The OpenAI-compatible HTTP front end (server.h) on libmicrohttpd and cJSON. */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <omp.h>

#include "linmoe/server.h"

#define MAX_STOPS 4
#define MAX_STOP_BYTES 256
#define MAX_TOP_LOGPROBS 20
#define N_HIST 12
#define NSTATUS 10

extern const char lm_chat_page_html[]; /* chat_page.c */

/* ---------------------------------------------------------------- jobs */

typedef struct {
    int32_t id;
    float lp;
    int n_top;
    int32_t top_id[MAX_TOP_LOGPROBS];
    float top_lp[MAX_TOP_LOGPROBS];
} tok_info;

typedef struct job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    /* request */
    int chat, stream, echo, logprobs; /* logprobs: top-n, -1 off */
    int ignore_eos; /* vLLM's extension: <|endoftext|> does not end the completion */
    int32_t *prompt;
    int64_t n_prompt, max_tokens;
    lm_sampler_config sc;
    uint64_t seed;
    char *stops[MAX_STOPS];
    int n_stops, max_stop_len;
    char *echo_text;
    /* scheduler -> handler */
    int accepted; /* 0 waiting for the scheduler, 1 in the engine, -1 refused */
    lm_status refuse_st;
    char refuse_msg[1024];
    int64_t eid;
    int cancel; /* the client went away */
    tok_info *toks;
    int64_t n_toks, cap_toks;
    char *text;
    size_t text_len, text_cap;
    lm_tokenizer_stream ts;
    int stop_hit, done;
    lm_finish_reason why;
    int64_t n_cached;
    double t_submit, t_first, t_last;
    /* handler side (streaming) */
    char *out;
    size_t out_len, out_pos, out_cap;
    size_t text_sent;
    int64_t toks_sent;
    int sent_role, sent_final;
    char idstr[48];
    long created;
    struct job *next; /* inbox */
} job;

struct lm_server {
    lm_server_config c;
    char host[256], key[512], name[256];
    lm_model *m;
    lm_tokenizer *tok;
    int vocab; /* the model's vocab_size (prompt token ids are checked against it) */
    pthread_mutex_t tok_mu;
    lm_engine *eng;
    struct MHD_Daemon *d;
    int port;
    /* inbox and control (mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *inbox, *inbox_tail;
    int64_t *cancels;
    int n_cancels, cap_cancels;
    int stopping, sched_exit, sched_exited;
    pthread_t sched;
    int64_t next_job;
    /* metrics (mmu) */
    pthread_mutex_t mmu;
    int64_t req_total[8][NSTATUS]; /* [endpoint][status] */
    int64_t prompt_tokens, gen_tokens, cached_tokens;
    lm_engine_stats es;
    int model_threads; /* OpenMP threads of the scheduler thread, as it sees them */
    double ttft_sum, tpot_sum;
    int64_t ttft_n, tpot_n, ttft_h[N_HIST + 1], tpot_h[N_HIST + 1];
};

static const double hist_le[N_HIST] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                       0.1,   0.25,   0.5,   1,    2.5,   10};

enum { EP_COMPLETIONS, EP_CHAT, EP_MODELS, EP_HEALTH, EP_METRICS, EP_PAGE, EP_OTHER, EP_N };
static const char *ep_name[EP_N] = {
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/", "other"};
/* 499: the client closed the connection before the answer (nginx's code) */
static const int status_list[NSTATUS] = {200, 400, 401, 404, 405, 413, 429, 499, 500, 503};

void lm_server_config_default(lm_server_config *c) {
    memset(c, 0, sizeof(*c));
    c->host = "127.0.0.1";
    c->port = 8080;
    c->model_name = "linmoe";
    c->max_body_bytes = (int64_t)1 << 20;
    c->max_header_bytes = (int64_t)32 << 10;
    c->max_json_depth = 32;
    c->max_connections = 512;
    c->default_max_tokens = 16;
    lm_engine_config_default(&c->engine);
}

static void job_unref(job *j) {
    pthread_mutex_lock(&j->mu);
    const int r = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (r > 0)
        return;
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j->prompt);
    for (int i = 0; i < j->n_stops; i++)
        free(j->stops[i]);
    free(j->echo_text);
    free(j->toks);
    free(j->text);
    free(j->out);
    free(j);
}

static int buf_add(char **b, size_t *len, size_t *cap, const char *s, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t nc = *cap ? *cap : 256;
        while (nc < *len + n + 1)
            nc *= 2;
        char *nb = realloc(*b, nc);
        if (!nb)
            return -1;
        *b = nb;
        *cap = nc;
    }
    memcpy(*b + *len, s, n);
    *len += n;
    (*b)[*len] = '\0';
    return 0;
}

/* Append n bytes, each byte that is not part of valid UTF-8, and each NUL, replaced by
 * U+FFFD (the responses are JSON, which must be UTF-8, and cJSON strings end at a NUL;
 * a byte-level model can emit any byte). */
static int add_utf8(char **b, size_t *len, size_t *cap, const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        const int64_t bad = lm_utf8_invalid_at(s + i, n - i);
        size_t good = bad < 0 ? n - i : (size_t)bad;
        const char *z = memchr(s + i, '\0', good);
        if (z)
            good = (size_t)(z - (s + i));
        if (buf_add(b, len, cap, s + i, good))
            return -1;
        i += good;
        if (i < n) {
            if (buf_add(b, len, cap, "\xEF\xBF\xBD", 3))
                return -1;
            i++;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- metrics */

static void observe(int64_t *h, double *sum, int64_t *n, double v) {
    int i = 0;
    while (i < N_HIST && v > hist_le[i])
        i++;
    h[i]++;
    *sum += v;
    (*n)++;
}

static void count_request(lm_server *s, int ep, int status) {
    int k = 8; /* anything else: with 500 */
    for (int i = 0; i < NSTATUS; i++)
        if (status_list[i] == status)
            k = i;
    pthread_mutex_lock(&s->mmu);
    s->req_total[ep][k]++;
    pthread_mutex_unlock(&s->mmu);
}

/* ---------------------------------------------------------------- engine side */

/* log-softmax of logits at the chosen token and the top n (fp64 sums). */
static void fill_logprobs(tok_info *t, const float *lg, int V, int n) {
    double mx = -INFINITY;
    for (int v = 0; v < V; v++)
        if (lg[v] > mx)
            mx = lg[v];
    double z = 0;
    for (int v = 0; v < V; v++)
        z += exp((double)lg[v] - mx);
    const double lz = mx + log(z);
    t->lp = (float)((double)lg[t->id] - lz);
    t->n_top = 0;
    for (int v = 0; v < V; v++) {
        int k = t->n_top;
        if (k < n)
            t->n_top++;
        else if (!(lg[v] > lg[t->top_id[n - 1]]))
            continue;
        else
            k = n - 1;
        while (k > 0 && lg[v] > lg[t->top_id[k - 1]]) {
            t->top_id[k] = t->top_id[k - 1];
            k--;
        }
        t->top_id[k] = v;
    }
    for (int k = 0; k < t->n_top; k++)
        t->top_lp[k] = (float)((double)lg[t->top_id[k]] - lz);
}

/* A stop string in text at or after `from`: its offset, else -1. */
static int64_t find_stop(const job *j, size_t from) {
    int64_t best = -1;
    for (int i = 0; i < j->n_stops; i++) {
        const size_t L = strlen(j->stops[i]);
        for (size_t p = from; p + L <= j->text_len; p++)
            if (memcmp(j->text + p, j->stops[i], L) == 0) {
                if (best < 0 || (int64_t)p < best)
                    best = (int64_t)p;
                break;
            }
    }
    return best;
}

static int on_event(void *ctx, const lm_engine_event *ev) {
    lm_server *s = ctx;
    job *j = ev->user;
    const double now = lm_time_sec();
    int stop = 0;
    pthread_mutex_lock(&j->mu);
    if (ev->finish == LM_FINISH_NONE) {
        if (j->n_toks == j->cap_toks) {
            j->cap_toks = j->cap_toks ? 2 * j->cap_toks : 16;
            tok_info *nt = realloc(j->toks, sizeof(tok_info) * (size_t)j->cap_toks);
            LM_CHECK(nt != NULL);
            j->toks = nt;
        }
        tok_info *t = &j->toks[j->n_toks++];
        t->id = ev->token;
        t->n_top = 0;
        t->lp = 0;
        if (j->logprobs >= 0)
            fill_logprobs(t, ev->logits, lm_model_params(s->m)->cfg.vocab_size,
                          j->logprobs > 0 ? j->logprobs : 0);
        if (j->n_toks == 1)
            j->t_first = now;
        j->t_last = now;
        j->n_cached = ev->n_cached;
        char buf[512];
        const size_t before = j->text_len;
        if (ev->token < lm_tokenizer_vocab_size(s->tok)) {
            const int n = lm_tokenizer_stream_push(s->tok, &j->ts, ev->token, buf, sizeof buf);
            if (n > 0)
                LM_CHECK(add_utf8(&j->text, &j->text_len, &j->text_cap, buf, (size_t)n) == 0);
        }
        if (j->n_stops > 0 && j->text_len > before) {
            const size_t from =
                before >= (size_t)j->max_stop_len ? before - (size_t)j->max_stop_len + 1 : 0;
            const int64_t at = find_stop(j, from);
            if (at >= 0) {
                j->text_len = (size_t)at;
                j->text[at] = '\0';
                j->stop_hit = stop = 1;
            }
        }
    } else {
        if (!j->stop_hit) {
            char buf[16];
            const int n = lm_tokenizer_stream_flush(&j->ts, buf, sizeof buf);
            if (n > 0)
                LM_CHECK(add_utf8(&j->text, &j->text_len, &j->text_cap, buf, (size_t)n) == 0);
        }
        j->done = 1;
        j->why = ev->finish;
        j->n_cached = ev->n_cached;
        if (ev->finish == LM_FINISH_ERROR)
            snprintf(j->refuse_msg, sizeof j->refuse_msg, "%s", ev->error ? ev->error : "error");
    }
    const int64_t ntok = j->n_toks;
    const double ttft = j->t_first - j->t_submit, span = j->t_last - j->t_first;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (ev->finish != LM_FINISH_NONE) {
        pthread_mutex_lock(&s->mmu);
        s->prompt_tokens += j->n_prompt;
        s->gen_tokens += ntok;
        s->cached_tokens += ev->n_cached;
        if (ntok > 0)
            observe(s->ttft_h, &s->ttft_sum, &s->ttft_n, ttft);
        if (ntok > 1)
            observe(s->tpot_h, &s->tpot_sum, &s->tpot_n, span / (double)(ntok - 1));
        pthread_mutex_unlock(&s->mmu);
        job_unref(j); /* the engine's reference */
    }
    return stop;
}

static void *scheduler(void *arg) {
    lm_server *s = arg;
    lm_error err = {0};
    /* an OpenMP thread count set with lm_set_num_threads holds for the thread that set
     * it; this thread would otherwise run OpenMP's default (every core) */
    omp_set_num_threads(s->c.threads);
    pthread_mutex_lock(&s->mmu);
    s->model_threads = omp_get_max_threads();
    pthread_mutex_unlock(&s->mmu);
    for (;;) {
        pthread_mutex_lock(&s->mu);
        job *in = s->inbox;
        s->inbox = s->inbox_tail = NULL;
        int64_t cancels[64];
        int nc = 0;
        while (s->n_cancels > 0 && nc < 64)
            cancels[nc++] = s->cancels[--s->n_cancels];
        const int stopping = s->stopping, exit_now = s->sched_exit;
        pthread_mutex_unlock(&s->mu);
        while (in) {
            job *j = in;
            in = in->next;
            lm_engine_request r = {
                j->prompt, j->n_prompt, j->max_tokens, j->sc, j->seed, lm_tokenizer_eot(s->tok), j};
            int64_t id = 0;
            lm_status st = stopping ? LM_ERR_BUSY : lm_engine_submit(s->eng, &r, &id, &err);
            pthread_mutex_lock(&j->mu);
            if (st == LM_OK) {
                j->accepted = 1;
                j->eid = id;
                if (j->cancel)
                    lm_engine_cancel(s->eng, id);
            } else {
                j->accepted = -1;
                j->refuse_st = stopping ? LM_ERR_UNSUPPORTED : st;
                snprintf(j->refuse_msg, sizeof j->refuse_msg, "%s",
                         stopping ? "the server is shutting down" : err.msg);
            }
            pthread_cond_broadcast(&j->cv);
            pthread_mutex_unlock(&j->mu);
            if (st != LM_OK)
                job_unref(j);
        }
        for (int i = 0; i < nc; i++)
            lm_engine_cancel(s->eng, cancels[i]);
        if (exit_now) {
            lm_engine_cancel_all(s->eng);
            if (lm_engine_pending(s->eng) == 0) {
                pthread_mutex_lock(&s->mu);
                s->sched_exited = 1;
                in = s->inbox;
                s->inbox = s->inbox_tail = NULL;
                pthread_mutex_unlock(&s->mu);
                while (in) { /* arrived meanwhile: refused */
                    job *j = in;
                    in = in->next;
                    pthread_mutex_lock(&j->mu);
                    j->accepted = -1;
                    j->refuse_st = LM_ERR_UNSUPPORTED;
                    snprintf(j->refuse_msg, sizeof j->refuse_msg, "the server is shutting down");
                    pthread_cond_broadcast(&j->cv);
                    pthread_mutex_unlock(&j->mu);
                    job_unref(j);
                }
                break;
            }
        }
        int did = 0;
        lm_engine_step(s->eng, &did, &err);
        pthread_mutex_lock(&s->mmu);
        lm_engine_get_stats(s->eng, &s->es);
        pthread_mutex_unlock(&s->mmu);
        if (!did) {
            pthread_mutex_lock(&s->mu);
            if (!s->inbox && s->n_cancels == 0 && !s->sched_exit) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += 20 * 1000000L;
                if (ts.tv_nsec >= 1000000000L)
                    ts.tv_sec++, ts.tv_nsec -= 1000000000L;
                pthread_cond_timedwait(&s->cv, &s->mu, &ts);
            }
            pthread_mutex_unlock(&s->mu);
        }
    }
    return NULL;
}

static void post_cancel(lm_server *s, job *j) {
    pthread_mutex_lock(&j->mu);
    j->cancel = 1;
    const int acc = j->accepted;
    const int64_t id = j->eid;
    const int done = j->done;
    pthread_mutex_unlock(&j->mu);
    if (acc != 1 || done)
        return; /* not yet in the engine: the scheduler cancels on entry */
    pthread_mutex_lock(&s->mu);
    if (s->n_cancels == s->cap_cancels) {
        s->cap_cancels = s->cap_cancels ? 2 * s->cap_cancels : 64;
        int64_t *nc = realloc(s->cancels, sizeof(int64_t) * (size_t)s->cap_cancels);
        LM_CHECK(nc != NULL);
        s->cancels = nc;
    }
    s->cancels[s->n_cancels++] = id;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---------------------------------------------------------------- HTTP helpers */

typedef struct {
    char *body;
    size_t len, cap;
    int too_large;
    int ep;
} conn_ctx;

static enum MHD_Result send_buf(struct MHD_Connection *c, int status, const char *type,
                                const char *body, size_t len) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_json(lm_server *s, struct MHD_Connection *c, int ep, int status,
                                 cJSON *o) {
    char *t = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    count_request(s, ep, status);
    if (!t)
        return send_buf(c, 500, "text/plain", "out of memory\n", 14);
    enum MHD_Result r = send_buf(c, status, "application/json", t, strlen(t));
    cJSON_free(t);
    return r;
}

static const char *err_type(int status) {
    switch (status) {
    case 401:
        return "authentication_error";
    case 404:
        return "not_found_error";
    case 429:
        return "rate_limit_error";
    case 503:
        return "server_error";
    default:
        return "invalid_request_error";
    }
}

/* OpenAI's error object: {"error": {"message", "type", "param", "code"}}. */
static cJSON *error_obj(int status, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static cJSON *error_obj(int status, const char *param, const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* messages may quote user input: keep them valid UTF-8 for the JSON */
    if (lm_utf8_invalid_at(msg, strlen(msg)) >= 0)
        snprintf(msg, sizeof msg, "invalid value for '%s'", param ? param : "request");
    cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", err_type(status));
    if (param)
        cJSON_AddStringToObject(e, "param", param);
    else
        cJSON_AddNullToObject(e, "param");
    if (code)
        cJSON_AddStringToObject(e, "code", code);
    else
        cJSON_AddNullToObject(e, "code");
    return o;
}

int64_t lm_utf8_invalid_at(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        const unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int len;
        unsigned cp;
        if (c >= 0xC2 && c <= 0xDF)
            len = 2, cp = c & 0x1F;
        else if (c >= 0xE0 && c <= 0xEF)
            len = 3, cp = c & 0x0F;
        else if (c >= 0xF0 && c <= 0xF4)
            len = 4, cp = c & 0x07;
        else
            return (int64_t)i;
        if (i + (size_t)len > n)
            return (int64_t)i;
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return (int64_t)i;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return (int64_t)i;
        i += (size_t)len;
    }
    return -1;
}

/* Nesting depth of a JSON text (brackets outside strings). */
static int json_depth(const char *s, size_t n) {
    int d = 0, mx = 0, in_str = 0;
    for (size_t i = 0; i < n; i++) {
        const char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = 0;
        } else if (c == '"') {
            in_str = 1;
        } else if (c == '[' || c == '{') {
            if (++d > mx)
                mx = d;
        } else if (c == ']' || c == '}') {
            d--;
        }
    }
    return mx;
}

static int const_eq(const char *a, const char *b) {
    const size_t na = strlen(a), nb = strlen(b);
    unsigned char x = na != nb;
    for (size_t i = 0; i < na; i++)
        x |= (unsigned char)(a[i] ^ b[i % (nb ? nb : 1)]);
    return x == 0;
}

/* 1 when the client's socket was closed (or broke). */
static int client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 0;
    struct pollfd p = {ci->connect_fd, POLLIN, 0};
    if (poll(&p, 1, 0) <= 0)
        return 0;
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL))
        return 1;
    if (p.revents & POLLIN) {
        char b;
        const ssize_t r = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        return r == 0;
    }
    return 0;
}

/* ---------------------------------------------------------------- parameters */

typedef struct {
    int status;
    cJSON *err;
} perr;

#define BAD(param, ...)                                                                            \
    do {                                                                                           \
        pe->status = 400;                                                                          \
        pe->err = error_obj(400, param, "invalid_value", __VA_ARGS__);                             \
        return -1;                                                                                 \
    } while (0)

static int get_int(const cJSON *o, const char *name, int64_t lo, int64_t hi, int64_t *out,
                   perr *pe) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        BAD(name, "'%s' must be an integer", name);
    if (!(v->valuedouble >= (double)lo && v->valuedouble <= (double)hi))
        BAD(name, "'%s' = %.17g is outside [%lld, %lld]", name, v->valuedouble, (long long)lo,
            (long long)hi);
    *out = (int64_t)v->valuedouble;
    return 1;
}

static int get_num(const cJSON *o, const char *name, double lo, double hi, double *out, perr *pe) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsNumber(v))
        BAD(name, "'%s' must be a number", name);
    if (!(v->valuedouble >= lo && v->valuedouble <= hi))
        BAD(name, "'%s' = %.17g is outside [%g, %g]", name, v->valuedouble, lo, hi);
    *out = v->valuedouble;
    return 1;
}

static int get_bool(const cJSON *o, const char *name, int *out, perr *pe) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsBool(v))
        BAD(name, "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(v);
    return 1;
}

static int add_tokens(lm_server *s, job *j, const char *text, size_t len) {
    lm_error err = {0};
    int64_t cap = j->n_prompt + 64;
    int32_t *ids = realloc(j->prompt, sizeof(int32_t) * (size_t)cap);
    if (!ids)
        return -1;
    j->prompt = ids;
    pthread_mutex_lock(&s->tok_mu);
    lm_status st = lm_tokenizer_encode(s->tok, text, len, &j->prompt, &j->n_prompt, &cap, &err);
    pthread_mutex_unlock(&s->tok_mu);
    return st == LM_OK ? 0 : -1;
}

/* The request body into a job (parameters checked); NULL with pe filled on error. */
static job *parse_request(lm_server *s, int chat, const cJSON *o, perr *pe) {
    job *j = calloc(1, sizeof(*j));
    if (!j) {
        pe->status = 503;
        pe->err = error_obj(503, NULL, "out_of_memory", "out of memory");
        return NULL;
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1;
    j->chat = chat;
    j->logprobs = -1;
    const int V = s->vocab;
    const int64_t ctx = s->c.engine.max_len;
#define BADJ(param, ...)                                                                           \
    do {                                                                                           \
        pe->status = 400;                                                                          \
        pe->err = error_obj(400, param, "invalid_value", __VA_ARGS__);                             \
        goto fail;                                                                                 \
    } while (0)
#define TRY(x)                                                                                     \
    do {                                                                                           \
        if ((x) < 0)                                                                               \
            goto fail;                                                                             \
    } while (0)
    if (!cJSON_IsObject(o)) {
        pe->status = 400;
        pe->err = error_obj(400, NULL, "invalid_value", "the request body must be a JSON object");
        goto fail;
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(o, "model");
    if (model && !cJSON_IsNull(model) && !cJSON_IsString(model)) {
        pe->status = 400;
        pe->err = error_obj(400, "model", "invalid_value", "'model' must be a string");
        goto fail;
    }
    int64_t n = 1;
    TRY(get_int(o, "n", 1, 1, &n, pe));
    double pen = 0;
    TRY(get_num(o, "presence_penalty", 0, 0, &pen, pe));
    TRY(get_num(o, "frequency_penalty", 0, 0, &pen, pe));
    /* the prompt: <|endoftext|> then the text (as `linmoe generate`) */
    j->prompt = malloc(sizeof(int32_t) * 64);
    if (!j->prompt)
        goto oom;
    j->prompt[j->n_prompt++] = lm_tokenizer_eot(s->tok);
    if (chat) {
        const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(o, "messages");
        if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) < 1) {
            pe->status = 400;
            pe->err = error_obj(400, "messages", "invalid_value",
                                "'messages' must be a non-empty array of {role, content}");
            goto fail;
        }
        const int nm = cJSON_GetArraySize(msgs);
        const char **roles = calloc((size_t)nm, sizeof(char *));
        const char **conts = calloc((size_t)nm, sizeof(char *));
        if (!roles || !conts) {
            free(roles);
            free(conts);
            goto oom;
        }
        int k = 0, bad = -1;
        const char *badp = "messages";
        for (const cJSON *m = msgs->child; m; m = m->next, k++) {
            const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role"),
                        *c = cJSON_GetObjectItemCaseSensitive(m, "content");
            if (!cJSON_IsObject(m) || !cJSON_IsString(r) ||
                (strcmp(r->valuestring, "system") && strcmp(r->valuestring, "user") &&
                 strcmp(r->valuestring, "assistant") && strcmp(r->valuestring, "developer"))) {
                bad = k;
                badp = "role";
                break;
            }
            if (!cJSON_IsString(c)) {
                bad = k;
                badp = "content";
                break;
            }
            roles[k] = r->valuestring;
            conts[k] = c->valuestring;
        }
        if (bad >= 0) {
            free(roles);
            free(conts);
            pe->status = 400;
            char pn[64];
            snprintf(pn, sizeof pn, "messages[%d].%s", bad, badp);
            pe->err = error_obj(400, pn, "invalid_value",
                                strcmp(badp, "role") == 0
                                    ? "'%s' must be \"system\", \"user\" or \"assistant\""
                                    : "'%s' must be a string",
                                pn);
            goto fail;
        }
        char *t = lm_chat_template(roles, conts, nm);
        free(roles);
        free(conts);
        if (!t || add_tokens(s, j, t, strlen(t)) < 0) {
            free(t);
            goto oom;
        }
        free(t);
        /* the template's turn marker ends the answer */
        j->stops[j->n_stops++] = strdup("\nUser:");
    } else {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "prompt");
        if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(p->child))
            p = p->child;
        if (cJSON_IsString(p)) {
            if (p->valuestring[0] && add_tokens(s, j, p->valuestring, strlen(p->valuestring)) < 0)
                goto oom;
        } else if (cJSON_IsArray(p) && cJSON_GetArraySize(p) > 0) {
            const int64_t np = cJSON_GetArraySize(p);
            int32_t *ids = realloc(j->prompt, sizeof(int32_t) * (size_t)(np + 1));
            if (!ids)
                goto oom;
            j->prompt = ids;
            int64_t k = 0;
            for (const cJSON *t = p->child; t; t = t->next, k++) {
                if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) ||
                    !(t->valuedouble >= 0 && t->valuedouble < V)) {
                    pe->status = 400;
                    pe->err =
                        error_obj(400, "prompt", "invalid_value",
                                  "'prompt'[%lld] must be a token id in [0, %d)", (long long)k, V);
                    goto fail;
                }
                j->prompt[j->n_prompt++] = (int32_t)t->valuedouble;
            }
        } else {
            pe->status = 400;
            pe->err = error_obj(400, "prompt", "invalid_value",
                                "'prompt' must be a string or an array of token ids");
            goto fail;
        }
        TRY(get_bool(o, "echo", &j->echo, pe));
        if (j->echo) {
            char *t = NULL, *u = NULL;
            size_t tl = 0, ul = 0, uc = 0;
            if (lm_tokenizer_decode(s->tok, j->prompt + 1, j->n_prompt - 1, &t, &tl, NULL) !=
                    LM_OK ||
                add_utf8(&u, &ul, &uc, t, tl) || buf_add(&u, &ul, &uc, "", 0)) {
                free(t);
                free(u);
                goto oom;
            }
            free(t);
            j->echo_text = u;
        }
    }
    if (j->n_prompt >= ctx) {
        pe->status = 413;
        pe->err = error_obj(413, chat ? "messages" : "prompt", "context_length_exceeded",
                            "the prompt is %lld tokens; this model's context is %lld tokens",
                            (long long)j->n_prompt, (long long)ctx);
        goto fail;
    }
    /* max_tokens (chat: also max_completion_tokens) */
    int64_t mt = chat ? ctx - j->n_prompt : s->c.default_max_tokens;
    if (mt > ctx - j->n_prompt)
        mt = ctx - j->n_prompt;
    int64_t v = 0;
    const int64_t big = (int64_t)1 << 53;
    int got = get_int(o, "max_tokens", -big, big, &v, pe);
    TRY(got);
    if (!got && chat) {
        got = get_int(o, "max_completion_tokens", -big, big, &v, pe);
        TRY(got);
    }
    if (got) {
        if (v < 0)
            BADJ("max_tokens", "'max_tokens' = %lld must be >= 0", (long long)v);
        if (v > ctx - j->n_prompt)
            BADJ("max_tokens",
                 "'max_tokens' = %lld: the prompt (%lld tokens) plus max_tokens exceeds this "
                 "model's context of %lld tokens",
                 (long long)v, (long long)j->n_prompt, (long long)ctx);
        mt = v;
    }
    j->max_tokens = mt;
    double temp = 1, top_p = 1;
    int64_t top_k = 0, seed = -1;
    TRY(get_num(o, "temperature", 0, 2, &temp, pe));
    TRY(get_num(o, "top_p", 1e-9, 1, &top_p, pe));
    TRY(get_int(o, "top_k", 0, 1 << 30, &top_k, pe));
    TRY(get_int(o, "seed", -(((int64_t)1) << 53), ((int64_t)1) << 53, &seed, pe));
    j->sc = (lm_sampler_config){(float)temp, (int)top_k, (float)top_p};
    pthread_mutex_lock(&s->mu);
    const int64_t jn = ++s->next_job;
    pthread_mutex_unlock(&s->mu);
    /* without a seed: a per-request one (the seeding scheme of `linmoe generate`
     * --seed S is seed = S) */
    j->seed = seed >= 0 ? (uint64_t)seed : 0x9e3779b97f4a7c15ULL * (uint64_t)jn + 1;
    TRY(get_bool(o, "stream", &j->stream, pe));
    TRY(get_bool(o, "ignore_eos", &j->ignore_eos, pe));
    /* stop: a string or up to 4 */
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "stop");
    if (st && !cJSON_IsNull(st)) {
        const cJSON *one = cJSON_IsString(st) ? st : NULL;
        if (!one && (!cJSON_IsArray(st) || cJSON_GetArraySize(st) > MAX_STOPS))
            BADJ("stop", "'stop' must be a string or an array of up to %d strings", MAX_STOPS);
        for (const cJSON *x = one ? one : st->child; x; x = one ? NULL : x->next) {
            if (!cJSON_IsString(x) || !x->valuestring[0] || strlen(x->valuestring) > MAX_STOP_BYTES)
                BADJ("stop", "'stop' strings must be non-empty strings of at most %d bytes",
                     MAX_STOP_BYTES);
            if (j->n_stops < MAX_STOPS + 1)
                j->stops[j->n_stops++] = strdup(x->valuestring);
            if (one)
                break;
        }
    }
    for (int i = 0; i < j->n_stops; i++) {
        if (!j->stops[i])
            goto oom;
        const int L = (int)strlen(j->stops[i]);
        if (L > j->max_stop_len)
            j->max_stop_len = L;
    }
    /* logprobs: completions: an integer 0..20; chat: a boolean + top_logprobs */
    if (chat) {
        int lp = 0;
        TRY(get_bool(o, "logprobs", &lp, pe));
        int64_t top = 0;
        TRY(get_int(o, "top_logprobs", 0, MAX_TOP_LOGPROBS, &top, pe));
        if (lp)
            j->logprobs = (int)top;
    } else {
        const cJSON *lp = cJSON_GetObjectItemCaseSensitive(o, "logprobs");
        if (lp && !cJSON_IsNull(lp)) {
            int64_t k = 0;
            TRY(get_int(o, "logprobs", 0, MAX_TOP_LOGPROBS, &k, pe));
            j->logprobs = (int)k;
        }
    }
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(o, "stream_options");
    if (so && !cJSON_IsNull(so) && !cJSON_IsObject(so))
        BADJ("stream_options", "'stream_options' must be an object");
    return j;
oom:
    pe->status = 503;
    pe->err = error_obj(503, NULL, "out_of_memory", "out of memory");
fail:
    job_unref(j);
    return NULL;
#undef TRY
#undef BADJ
}

/* ---------------------------------------------------------------- responses */

static void job_id(lm_server *s, job *j) {
    (void)s;
    snprintf(j->idstr, sizeof j->idstr, "%s-%llx%06llx", j->chat ? "chatcmpl" : "cmpl",
             (unsigned long long)time(NULL), (unsigned long long)(j->seed & 0xffffff));
    j->created = (long)time(NULL);
}

static const char *finish_str(const job *j) {
    if (j->stop_hit || j->why == LM_FINISH_STOP)
        return "stop";
    if (j->why == LM_FINISH_LENGTH)
        return "length";
    return "stop";
}

/* A token's text for logprobs: its bytes when they are valid UTF-8, else "bytes:\xNN". */
static void token_str(lm_server *s, int32_t id, char *buf, size_t size) {
    size_t n = 0;
    const uint8_t *b = lm_tokenizer_token_bytes(s->tok, id, &n);
    if (!b) {
        snprintf(buf, size, "%s", "<|endoftext|>");
        return;
    }
    if (n + 1 < size && lm_utf8_invalid_at((const char *)b, n) < 0) {
        memcpy(buf, b, n);
        buf[n] = '\0';
        return;
    }
    size_t o = (size_t)snprintf(buf, size, "bytes:");
    for (size_t i = 0; i < n && o + 5 < size; i++)
        o += (size_t)snprintf(buf + o, size - o, "\\x%02x", b[i]);
}

static cJSON *bytes_arr(lm_server *s, int32_t id) {
    size_t n = 0;
    const uint8_t *b = lm_tokenizer_token_bytes(s->tok, id, &n);
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; b && i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(b[i]));
    return a;
}

/* logprobs of tokens [t0, t1) */
static cJSON *logprobs_obj(lm_server *s, const job *j, int64_t t0, int64_t t1, size_t off0) {
    char buf[256];
    if (j->chat) {
        cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "content");
        for (int64_t i = t0; i < t1; i++) {
            const tok_info *t = &j->toks[i];
            cJSON *e = cJSON_CreateObject();
            token_str(s, t->id, buf, sizeof buf);
            cJSON_AddStringToObject(e, "token", buf);
            cJSON_AddNumberToObject(e, "logprob", t->lp);
            cJSON_AddItemToObject(e, "bytes", bytes_arr(s, t->id));
            cJSON *tl = cJSON_AddArrayToObject(e, "top_logprobs");
            for (int k = 0; k < t->n_top; k++) {
                cJSON *x = cJSON_CreateObject();
                token_str(s, t->top_id[k], buf, sizeof buf);
                cJSON_AddStringToObject(x, "token", buf);
                cJSON_AddNumberToObject(x, "logprob", t->top_lp[k]);
                cJSON_AddItemToObject(x, "bytes", bytes_arr(s, t->top_id[k]));
                cJSON_AddItemToArray(tl, x);
            }
            cJSON_AddItemToArray(a, e);
        }
        return o;
    }
    cJSON *o = cJSON_CreateObject(), *tk = cJSON_AddArrayToObject(o, "tokens"),
          *lp = cJSON_AddArrayToObject(o, "token_logprobs"),
          *tl = cJSON_AddArrayToObject(o, "top_logprobs"),
          *to = cJSON_AddArrayToObject(o, "text_offset");
    size_t off = off0;
    for (int64_t i = t0; i < t1; i++) {
        const tok_info *t = &j->toks[i];
        token_str(s, t->id, buf, sizeof buf);
        cJSON_AddItemToArray(tk, cJSON_CreateString(buf));
        cJSON_AddItemToArray(lp, cJSON_CreateNumber(t->lp));
        cJSON *m = cJSON_CreateObject();
        for (int k = 0; k < t->n_top; k++) {
            char b2[256];
            token_str(s, t->top_id[k], b2, sizeof b2);
            if (!cJSON_GetObjectItemCaseSensitive(m, b2))
                cJSON_AddNumberToObject(m, b2, t->top_lp[k]);
        }
        cJSON_AddItemToArray(tl, m);
        cJSON_AddItemToArray(to, cJSON_CreateNumber((double)off));
        size_t n = 0;
        lm_tokenizer_token_bytes(s->tok, t->id, &n);
        off += n;
    }
    return o;
}

static cJSON *usage_obj(const job *j) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)j->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", (double)j->n_toks);
    cJSON_AddNumberToObject(u, "total_tokens", (double)(j->n_prompt + j->n_toks));
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", (double)j->n_cached);
    return u;
}

static cJSON *response_head(lm_server *s, const job *j, int chunk) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", j->idstr);
    cJSON_AddStringToObject(o, "object",
                            j->chat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                    : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)j->created);
    cJSON_AddStringToObject(o, "model", s->name);
    cJSON_AddStringToObject(o, "system_fingerprint",
                            "linmoe-"
                            "cpu");
    return o;
}

/* The whole (non-streamed) response; j->mu held, j done. */
static cJSON *final_response(lm_server *s, job *j) {
    cJSON *o = response_head(s, j, 0);
    cJSON *ch = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    if (j->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddStringToObject(m, "content", j->text ? j->text : "");
    } else {
        char *t = NULL;
        size_t tl = 0, tc = 0;
        if (j->echo_text)
            LM_CHECK(buf_add(&t, &tl, &tc, j->echo_text, strlen(j->echo_text)) == 0);
        LM_CHECK(buf_add(&t, &tl, &tc, j->text ? j->text : "", j->text_len) == 0);
        cJSON_AddStringToObject(c, "text", t);
        free(t);
    }
    if (j->logprobs >= 0)
        cJSON_AddItemToObject(
            c, "logprobs",
            logprobs_obj(s, j, 0, j->n_toks, j->echo_text ? strlen(j->echo_text) : 0));
    else
        cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddStringToObject(c, "finish_reason", finish_str(j));
    cJSON_AddItemToArray(ch, c);
    cJSON_AddItemToObject(o, "usage", usage_obj(j));
    return o;
}

/* Wait for the scheduler's answer to a submitted job. 0 accepted, else refused. */
static int wait_accepted(job *j) {
    pthread_mutex_lock(&j->mu);
    while (j->accepted == 0)
        pthread_cond_wait(&j->cv, &j->mu);
    const int a = j->accepted;
    pthread_mutex_unlock(&j->mu);
    return a == 1 ? 0 : -1;
}

static int submit(lm_server *s, job *j) {
    pthread_mutex_lock(&j->mu);
    j->refs++; /* the scheduler's / engine's */
    j->t_submit = lm_time_sec();
    pthread_mutex_unlock(&j->mu);
    pthread_mutex_lock(&s->mu);
    if (s->sched_exited) {
        pthread_mutex_unlock(&s->mu);
        pthread_mutex_lock(&j->mu);
        j->refs--;
        j->accepted = -1;
        j->refuse_st = LM_ERR_UNSUPPORTED;
        snprintf(j->refuse_msg, sizeof j->refuse_msg, "the server is shutting down");
        pthread_mutex_unlock(&j->mu);
        return -1;
    }
    if (s->inbox_tail)
        s->inbox_tail->next = j;
    else
        s->inbox = j;
    s->inbox_tail = j;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return wait_accepted(j);
}

static cJSON *refusal(job *j, int *status) {
    if (j->refuse_st == LM_ERR_BUSY) {
        *status = 429;
        return error_obj(429, NULL, "queue_full", "%s; retry later", j->refuse_msg);
    }
    if (j->refuse_st == LM_ERR_RANGE) {
        *status = 413;
        return error_obj(413, "prompt", "context_length_exceeded", "%s", j->refuse_msg);
    }
    if (j->refuse_st == LM_ERR_UNSUPPORTED) {
        *status = 503;
        return error_obj(503, NULL, "unavailable", "%s", j->refuse_msg);
    }
    *status = 400;
    return error_obj(400, NULL, "invalid_value", "%s", j->refuse_msg);
}

/* ---------------------------------------------------------------- streaming */

static void sse_add(job *j, cJSON *o) {
    char *t = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    LM_CHECK(t != NULL);
    LM_CHECK(buf_add(&j->out, &j->out_len, &j->out_cap, "data: ", 6) == 0);
    LM_CHECK(buf_add(&j->out, &j->out_len, &j->out_cap, t, strlen(t)) == 0);
    LM_CHECK(buf_add(&j->out, &j->out_len, &j->out_cap, "\n\n", 2) == 0);
    cJSON_free(t);
}

static cJSON *chunk_obj(lm_server *s, job *j, const char *text, size_t n, int64_t t0, int64_t t1,
                        const char *finish) {
    cJSON *o = response_head(s, j, 1);
    cJSON *ch = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    char *tmp = malloc(n + 1);
    LM_CHECK(tmp != NULL);
    if (n > 0) /* text may be NULL for an empty chunk (the final one): UBSan */
        memcpy(tmp, text, n);
    tmp[n] = '\0';
    if (j->chat) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (!j->sent_role) {
            cJSON_AddStringToObject(d, "role", "assistant");
            j->sent_role = 1;
        }
        if (n > 0 || !finish)
            cJSON_AddStringToObject(d, "content", tmp);
    } else {
        cJSON_AddStringToObject(c, "text", tmp);
    }
    free(tmp);
    if (j->logprobs >= 0 && t1 > t0)
        cJSON_AddItemToObject(c, "logprobs", logprobs_obj(s, j, t0, t1, 0));
    else
        cJSON_AddNullToObject(c, "logprobs");
    if (finish)
        cJSON_AddStringToObject(c, "finish_reason", finish);
    else
        cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddItemToArray(ch, c);
    return o;
}

typedef struct {
    lm_server *s;
    job *j;
    struct MHD_Connection *conn;
} stream_ctx;

/* New SSE bytes from j's state into j->out; j->mu held. */
static void stream_fill(lm_server *s, job *j) {
    if (j->sent_final)
        return;
    size_t safe = j->text_len;
    if (!j->done && j->max_stop_len > 1) {
        /* hold back what could be the start of a stop string */
        safe = j->text_len > (size_t)j->max_stop_len - 1 ? j->text_len - (size_t)j->max_stop_len + 1
                                                         : 0;
        while (safe > j->text_sent && ((unsigned char)j->text[safe] & 0xC0) == 0x80)
            safe--;
    }
    if (safe < j->text_sent)
        safe = j->text_sent;
    const int new_toks = j->logprobs >= 0 && j->n_toks > j->toks_sent;
    if (safe > j->text_sent || new_toks || (j->chat && !j->sent_role)) {
        sse_add(j, chunk_obj(s, j, j->text + j->text_sent, safe - j->text_sent, j->toks_sent,
                             j->n_toks, NULL));
        j->text_sent = safe;
        j->toks_sent = j->n_toks;
    }
    if (j->done) {
        if (j->why == LM_FINISH_ERROR) {
            cJSON *e = error_obj(500, NULL, "model_error", "%s", j->refuse_msg);
            sse_add(j, e);
        } else {
            cJSON *o = chunk_obj(s, j, "", 0, 0, 0, finish_str(j));
            cJSON_AddItemToObject(o, "usage", usage_obj(j));
            sse_add(j, o);
        }
        LM_CHECK(buf_add(&j->out, &j->out_len, &j->out_cap, "data: [DONE]\n\n", 14) == 0);
        j->sent_final = 1;
    }
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_ctx *x = cls;
    job *j = x->j;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        if (j->out_pos < j->out_len)
            break;
        j->out_len = j->out_pos = 0;
        if (j->sent_final) {
            pthread_mutex_unlock(&j->mu);
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        stream_fill(x->s, j);
        if (j->out_len > 0)
            break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000000L;
        if (ts.tv_nsec >= 1000000000L)
            ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (!j->done) {
            pthread_mutex_unlock(&j->mu);
            const int gone = client_gone(x->conn);
            pthread_mutex_lock(&j->mu);
            if (gone) {
                pthread_mutex_unlock(&j->mu);
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
        }
    }
    size_t n = j->out_len - j->out_pos;
    if (n > max)
        n = max;
    memcpy(buf, j->out + j->out_pos, n);
    j->out_pos += n;
    pthread_mutex_unlock(&j->mu);
    return (ssize_t)n;
}

static void stream_free(void *cls) {
    stream_ctx *x = cls;
    pthread_mutex_lock(&x->j->mu);
    const int done = x->j->done;
    pthread_mutex_unlock(&x->j->mu);
    if (!done)
        post_cancel(x->s, x->j);
    job_unref(x->j);
    free(x);
}

/* ---------------------------------------------------------------- endpoints */

static enum MHD_Result do_generate(lm_server *s, struct MHD_Connection *conn, conn_ctx *cc,
                                   int chat) {
    const int ep = chat ? EP_CHAT : EP_COMPLETIONS;
    const int64_t bad = lm_utf8_invalid_at(cc->body, cc->len);
    if (bad >= 0)
        return send_json(s, conn, ep, 400,
                         error_obj(400, NULL, "invalid_utf8",
                                   "the request body is not valid UTF-8 (byte %lld)",
                                   (long long)bad));
    if (json_depth(cc->body, cc->len) > s->c.max_json_depth)
        return send_json(s, conn, ep, 400,
                         error_obj(400, NULL, "invalid_json",
                                   "the request body nests JSON deeper than %d levels",
                                   s->c.max_json_depth));
    const char *end = NULL;
    cJSON *o = cJSON_ParseWithLengthOpts(cc->body, cc->len, &end, 0);
    if (!o)
        return send_json(s, conn, ep, 400,
                         error_obj(400, NULL, "invalid_json",
                                   "the request body is not valid JSON (near byte %lld)",
                                   (long long)(end ? end - cc->body : 0)));
    perr pe = {0, NULL};
    job *j = parse_request(s, chat, o, &pe);
    cJSON_Delete(o);
    if (!j)
        return send_json(s, conn, ep, pe.status, pe.err);
    job_id(s, j);
    if (submit(s, j) != 0) {
        int st;
        cJSON *e = refusal(j, &st);
        job_unref(j);
        return send_json(s, conn, ep, st, e);
    }
    if (j->stream) {
        stream_ctx *x = malloc(sizeof(*x));
        LM_CHECK(x != NULL);
        x->s = s;
        x->j = j;
        x->conn = conn;
        if (j->echo_text && j->echo_text[0]) {
            pthread_mutex_lock(&j->mu);
            sse_add(j, chunk_obj(s, j, j->echo_text, strlen(j->echo_text), 0, 0, NULL));
            pthread_mutex_unlock(&j->mu);
        }
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, x, stream_free);
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        count_request(s, ep, 200);
        enum MHD_Result ret = MHD_queue_response(conn, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    /* wait for the whole completion, watching the client */
    pthread_mutex_lock(&j->mu);
    while (!j->done) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000000L;
        if (ts.tv_nsec >= 1000000000L)
            ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (j->done)
            break;
        pthread_mutex_unlock(&j->mu);
        const int gone = client_gone(conn);
        pthread_mutex_lock(&j->mu);
        if (gone) {
            pthread_mutex_unlock(&j->mu);
            post_cancel(s, j);
            job_unref(j);
            count_request(s, ep, 499);
            return MHD_NO; /* close the connection */
        }
    }
    cJSON *resp;
    int status = 200;
    if (j->why == LM_FINISH_ERROR) {
        status = 500;
        resp = error_obj(500, NULL, "model_error", "%s", j->refuse_msg);
    } else if (j->why == LM_FINISH_CANCEL) {
        status = 503;
        resp = error_obj(503, NULL, "unavailable", "the server is shutting down");
    } else {
        resp = final_response(s, j);
    }
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
    return send_json(s, conn, ep, status, resp);
}

static enum MHD_Result do_metrics(lm_server *s, struct MHD_Connection *conn) {
    char *b = NULL;
    size_t len = 0, cap = 0;
    char line[512];
#define OUT(...)                                                                                   \
    do {                                                                                           \
        const int n_ = snprintf(line, sizeof line, __VA_ARGS__);                                   \
        LM_CHECK(buf_add(&b, &len, &cap, line, (size_t)n_) == 0);                                  \
    } while (0)
    pthread_mutex_lock(&s->mmu);
    OUT("# HELP linmoe_requests_total HTTP requests by endpoint and status.\n"
        "# TYPE linmoe_requests_total counter\n");
    for (int e = 0; e < EP_N; e++)
        for (int k = 0; k < NSTATUS; k++)
            if (s->req_total[e][k])
                OUT("linmoe_requests_total{endpoint=\"%s\",status=\"%d\"} %lld\n", ep_name[e],
                    status_list[k], (long long)s->req_total[e][k]);
    OUT("# HELP linmoe_prompt_tokens_total Prompt tokens of finished requests.\n"
        "# TYPE linmoe_prompt_tokens_total counter\nlinmoe_prompt_tokens_total %lld\n",
        (long long)s->prompt_tokens);
    OUT("# HELP linmoe_generation_tokens_total Generated tokens.\n"
        "# TYPE linmoe_generation_tokens_total counter\nlinmoe_generation_tokens_total %lld\n",
        (long long)s->gen_tokens);
    OUT("# HELP linmoe_queue_depth Requests waiting for a row.\n# TYPE linmoe_queue_depth "
        "gauge\nlinmoe_queue_depth %lld\n",
        (long long)s->es.waiting);
    OUT("# HELP linmoe_running_sequences Sequences in the state pool.\n# TYPE "
        "linmoe_running_sequences gauge\nlinmoe_running_sequences %lld\n",
        (long long)s->es.running);
    OUT("# HELP linmoe_model_threads OpenMP threads the model runs on.\n# TYPE "
        "linmoe_model_threads gauge\nlinmoe_model_threads %d\n",
        s->model_threads);
    OUT("# HELP linmoe_batch_size Rows in the last decode step.\n# TYPE linmoe_batch_size "
        "gauge\nlinmoe_batch_size %lld\n",
        (long long)s->es.last_batch);
    OUT("# HELP linmoe_prefix_cache_lookups_total Admitted requests that looked up the prefix "
        "cache.\n# TYPE linmoe_prefix_cache_lookups_total counter\n"
        "linmoe_prefix_cache_lookups_total %lld\n",
        (long long)s->es.prefix_lookups);
    OUT("# HELP linmoe_prefix_cache_hits_total Lookups that restored at least one block.\n"
        "# TYPE linmoe_prefix_cache_hits_total counter\nlinmoe_prefix_cache_hits_total %lld\n",
        (long long)s->es.prefix_hits);
    OUT("# HELP linmoe_prefix_cache_hit_rate Hits per lookup.\n# TYPE "
        "linmoe_prefix_cache_hit_rate gauge\nlinmoe_prefix_cache_hit_rate %.6f\n",
        s->es.prefix_lookups ? (double)s->es.prefix_hits / (double)s->es.prefix_lookups : 0.0);
    OUT("# HELP linmoe_prefix_cache_hit_tokens_total Prompt tokens restored from the prefix "
        "cache.\n# TYPE linmoe_prefix_cache_hit_tokens_total counter\n"
        "linmoe_prefix_cache_hit_tokens_total %lld\n",
        (long long)s->es.prefix_hit_tokens);
    OUT("# HELP linmoe_prefix_cache_bytes Bytes held by the prefix cache.\n# TYPE "
        "linmoe_prefix_cache_bytes gauge\nlinmoe_prefix_cache_bytes %lld\n",
        (long long)s->es.prefix_bytes);
    const char *hn[2] = {"linmoe_time_to_first_token_seconds",
                         "linmoe_time_per_output_token_seconds"};
    const char *hh[2] = {"Time from submission to the first generated token.",
                         "Mean time between generated tokens of a request."};
    int64_t *h[2] = {s->ttft_h, s->tpot_h};
    const double sum[2] = {s->ttft_sum, s->tpot_sum};
    const int64_t cnt[2] = {s->ttft_n, s->tpot_n};
    for (int k = 0; k < 2; k++) {
        OUT("# HELP %s %s\n# TYPE %s histogram\n", hn[k], hh[k], hn[k]);
        int64_t acc = 0;
        for (int i = 0; i < N_HIST; i++) {
            acc += h[k][i];
            OUT("%s_bucket{le=\"%g\"} %lld\n", hn[k], hist_le[i], (long long)acc);
        }
        OUT("%s_bucket{le=\"+Inf\"} %lld\n%s_sum %.6f\n%s_count %lld\n", hn[k], (long long)cnt[k],
            hn[k], sum[k], hn[k], (long long)cnt[k]);
    }
    pthread_mutex_unlock(&s->mmu);
#undef OUT
    count_request(s, EP_METRICS, 200);
    enum MHD_Result r = send_buf(conn, 200, "text/plain; version=0.0.4", b, len);
    free(b);
    return r;
}

static int endpoint_of(const char *url) {
    if (strcmp(url, "/v1/completions") == 0)
        return EP_COMPLETIONS;
    if (strcmp(url, "/v1/chat/completions") == 0)
        return EP_CHAT;
    if (strcmp(url, "/v1/models") == 0)
        return EP_MODELS;
    if (strcmp(url, "/health") == 0)
        return EP_HEALTH;
    if (strcmp(url, "/metrics") == 0)
        return EP_METRICS;
    if (strcmp(url, "/") == 0 || strcmp(url, "/index.html") == 0)
        return EP_PAGE;
    return EP_OTHER;
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *conn, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **con_cls) {
    (void)version;
    lm_server *s = cls;
    conn_ctx *cc = *con_cls;
    const int ep = endpoint_of(url);
    const int is_post = strcmp(method, "POST") == 0, is_get = strcmp(method, "GET") == 0;
    if (!cc) {
        cc = calloc(1, sizeof(*cc));
        if (!cc)
            return MHD_NO;
        cc->ep = ep;
        *con_cls = cc;
        /* refuse a declared oversized body before reading it */
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoll(cl, NULL, 10) > s->c.max_body_bytes) {
            cc->too_large = 1;
            return send_json(s, conn, ep, 413,
                             error_obj(413, NULL, "body_too_large",
                                       "the request body (%s bytes) exceeds %lld bytes", cl,
                                       (long long)s->c.max_body_bytes));
        }
        return MHD_YES;
    }
    if (*upload_size > 0) {
        if (!cc->too_large) {
            if ((int64_t)(cc->len + *upload_size) > s->c.max_body_bytes) {
                cc->too_large = 1;
                free(cc->body);
                cc->body = NULL;
                cc->len = cc->cap = 0;
            } else if (buf_add(&cc->body, &cc->len, &cc->cap, upload, *upload_size) != 0) {
                cc->too_large = 1;
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (cc->too_large)
        return send_json(s, conn, ep, 413,
                         error_obj(413, NULL, "body_too_large",
                                   "the request body exceeds %lld bytes",
                                   (long long)s->c.max_body_bytes));
    pthread_mutex_lock(&s->mu);
    const int stopping = s->stopping;
    pthread_mutex_unlock(&s->mu);
    if (stopping)
        return send_json(s, conn, ep, 503,
                         error_obj(503, NULL, "unavailable", "the server is shutting down"));
    if (ep == EP_PAGE && is_get) {
        count_request(s, EP_PAGE, 200);
        return send_buf(conn, 200, "text/html; charset=utf-8", lm_chat_page_html,
                        strlen(lm_chat_page_html));
    }
    if (s->key[0]) {
        const char *a = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
        if (!a || strncmp(a, "Bearer ", 7) != 0 || !const_eq(a + 7, s->key))
            return send_json(s, conn, ep, 401,
                             error_obj(401, NULL, "invalid_api_key",
                                       a ? "invalid API key in the Authorization header"
                                         : "missing 'Authorization: Bearer KEY' header"));
    }
    if (ep == EP_OTHER)
        return send_json(
            s, conn, ep, 404,
            error_obj(404, NULL, "not_found", "no such endpoint: %s %.200s", method, url));
    const int want_post = ep == EP_COMPLETIONS || ep == EP_CHAT;
    if ((want_post && !is_post) || (!want_post && !is_get))
        return send_json(s, conn, ep, 405,
                         error_obj(405, NULL, "method_not_allowed", "%s %s: use %s", method, url,
                                   want_post ? "POST" : "GET"));
    if (ep == EP_HEALTH) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", "ok");
        return send_json(s, conn, ep, 200, o);
    }
    if (ep == EP_METRICS)
        return do_metrics(s, conn);
    if (ep == EP_MODELS) {
        cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "data");
        cJSON_AddStringToObject(o, "object", "list");
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "id", s->name);
        cJSON_AddStringToObject(m, "object", "model");
        cJSON_AddNumberToObject(m, "created", 0);
        cJSON_AddStringToObject(m, "owned_by", "linmoe");
        cJSON_AddNumberToObject(m, "context_length", (double)s->c.engine.max_len);
        cJSON_AddItemToArray(a, m);
        return send_json(s, conn, ep, 200, o);
    }
    if (!cc->body)
        LM_CHECK(buf_add(&cc->body, &cc->len, &cc->cap, "", 0) == 0);
    return do_generate(s, conn, cc, ep == EP_CHAT);
}

static void completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
    (void)cls, (void)conn, (void)toe;
    conn_ctx *cc = *con_cls;
    if (!cc)
        return;
    free(cc->body);
    free(cc);
    *con_cls = NULL;
}

/* ---------------------------------------------------------------- lifecycle */

char *lm_chat_template(const char *const *roles, const char *const *contents, int n) {
    char *b = NULL;
    size_t len = 0, cap = 0;
    for (int i = 0; i < n; i++) {
        const char *tag = strcmp(roles[i], "user") == 0        ? "User: "
                          : strcmp(roles[i], "assistant") == 0 ? "Assistant: "
                                                               : "System: ";
        if (buf_add(&b, &len, &cap, tag, strlen(tag)) ||
            buf_add(&b, &len, &cap, contents[i], strlen(contents[i])) ||
            buf_add(&b, &len, &cap, "\n\n", 2)) {
            free(b);
            return NULL;
        }
    }
    if (buf_add(&b, &len, &cap, "Assistant:", 10)) {
        free(b);
        return NULL;
    }
    return b;
}

lm_status lm_server_start(lm_server **out, lm_model *m, lm_tokenizer *tok,
                          const lm_server_config *c, lm_error *err) {
    *out = NULL;
    if (!m || !tok || !c)
        return lm_errorf(err, LM_ERR_INVALID, "server: model, tokenizer, config");
    if (c->port < 0 || c->port > 65535)
        return lm_errorf(err, LM_ERR_INVALID, "server: port %d (want 0 .. 65535)", c->port);
    if (c->max_body_bytes < 1024 || c->max_header_bytes < 4096 || c->max_json_depth < 2 ||
        c->max_connections < 1 || c->default_max_tokens < 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "server: limits max_body_bytes %lld (>= 1024), max_header_bytes %lld "
                         "(>= 4096), max_json_depth %d (>= 2), max_connections %d (>= 1)",
                         (long long)c->max_body_bytes, (long long)c->max_header_bytes,
                         c->max_json_depth, c->max_connections);
    if (lm_tokenizer_vocab_size(tok) > lm_model_params(m)->cfg.vocab_size)
        return lm_errorf(err, LM_ERR_INVALID,
                         "server: the %s tokenizer (vocab %d) does not fit the model (vocab %d)",
                         lm_tokenizer_name(tok), lm_tokenizer_vocab_size(tok),
                         lm_model_params(m)->cfg.vocab_size);
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)c->port);
    const char *host = c->host ? c->host : "127.0.0.1";
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1)
        return lm_errorf(err, LM_ERR_INVALID, "server: host '%s' is not an IPv4 address", host);
    lm_server *s = LM_CALLOC(1, sizeof(*s));
    s->c = *c;
    snprintf(s->host, sizeof s->host, "%s", host);
    snprintf(s->key, sizeof s->key, "%s", c->api_key ? c->api_key : "");
    snprintf(s->name, sizeof s->name, "%s", c->model_name ? c->model_name : "linmoe");
    s->c.host = s->host;
    s->c.api_key = s->key;
    s->c.model_name = s->name;
    s->m = m;
    s->tok = tok;
    s->vocab = lm_model_params(m)->cfg.vocab_size;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->mmu, NULL);
    pthread_mutex_init(&s->tok_mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (s->c.threads <= 0)
        s->c.threads = lm_get_num_threads();
    lm_status st = lm_engine_new(&s->eng, m, &s->c.engine, on_event, s, err);
    if (st != LM_OK) {
        free(s);
        return st;
    }
    if (pthread_create(&s->sched, NULL, scheduler, s) != 0) {
        lm_engine_free(s->eng);
        free(s);
        return lm_errorf(err, LM_ERR_NOMEM, "server: cannot start the scheduler thread");
    }
    s->d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL, 0, NULL,
        NULL, handler, s, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)c->max_header_bytes,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)c->max_connections, MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)120, MHD_OPTION_NOTIFY_COMPLETED, completed, NULL, MHD_OPTION_END);
    if (!s->d) {
        pthread_mutex_lock(&s->mu);
        s->sched_exit = 1;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->sched, NULL);
        lm_engine_free(s->eng);
        free(s);
        return lm_errorf(err, LM_ERR_IO, "server: cannot listen on %s:%d: %s", host, c->port,
                         strerror(errno));
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : c->port;
    *out = s;
    return LM_OK;
}

int lm_server_port(const lm_server *s) { return s ? s->port : 0; }

void lm_server_stop(lm_server *s) {
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_mutex_unlock(&s->mu);
    /* cancel everything in the engine: the handlers waiting on it return */
    pthread_mutex_lock(&s->mu);
    s->sched_exit = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->sched, NULL);
    MHD_stop_daemon(s->d);
    lm_engine_free(s->eng);
    free(s->cancels);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->mmu);
    pthread_mutex_destroy(&s->tok_mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* The checks of do_generate without a model or a socket (server.h). */
int lm_server_check_request(lm_tokenizer *tok, int vocab, int64_t max_len, int chat,
                            const char *body, size_t len) {
    lm_server *s = calloc(1, sizeof(*s));
    LM_CHECK(s != NULL);
    lm_server_config_default(&s->c);
    s->c.engine.max_len = max_len;
    s->tok = tok;
    s->vocab = vocab;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->tok_mu, NULL);
    int status = 200;
    cJSON *e = NULL;
    if (lm_utf8_invalid_at(body, len) >= 0 || json_depth(body, len) > s->c.max_json_depth) {
        status = 400;
    } else {
        const char *end = NULL;
        cJSON *o = cJSON_ParseWithLengthOpts(body, len, &end, 0);
        if (!o) {
            status = 400;
        } else {
            perr pe = {0, NULL};
            job *j = parse_request(s, chat, o, &pe);
            cJSON_Delete(o);
            if (j) {
                job_id(s, j);
                job_unref(j);
            } else {
                status = pe.status;
                e = pe.err;
            }
        }
    }
    cJSON_Delete(e);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->tok_mu);
    free(s);
    return status;
}
