/* linmoe HTTP server (issue 23): an OpenAI-compatible front end on libmicrohttpd over
 * the serving engine (serve.h). docs/serving.md documents the endpoints, parameters,
 * the chat template and the limits; this header the C API.
 *
 * Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream":
 * server-sent events, `data: {json}` chunks then `data: [DONE]`), GET /v1/models,
 * GET /health, GET /metrics (Prometheus text format), GET / (the chat page: one HTML
 * file with its JavaScript, no external resources).
 *
 * Threads: libmicrohttpd runs one thread per connection (a handler may block until
 * its completion is done; a client that disconnects is noticed within ~20 ms by
 * polling its socket, and its sequence is cancelled, freeing its row at the next
 * scheduler step). One scheduler thread owns the engine: it moves submitted requests
 * into it, steps it, and the engine's callbacks (in that thread) append tokens and
 * decoded text to each request. Tokenizer encoding is serialised by a mutex (the GPT-2
 * piece cache is not thread-safe). All state is in the lm_server object: two servers
 * in one process do not interfere.
 *
 * Input limits (each refused with an OpenAI error object, never a crash): bodies over
 * max_body_bytes (413), request headers over max_header_bytes (libmicrohttpd answers
 * 431), JSON nested deeper than max_json_depth (400), bodies that are not valid UTF-8
 * (400, naming the byte offset), wrong types or out-of-range values (400 naming the
 * parameter), prompts longer than the context (413), max_tokens beyond the context
 * (400), a full queue (429), a server shutting down (503), a missing or wrong
 * `Authorization: Bearer KEY` when api_key is set (401; only GET / is served without
 * it: the page holds no data and asks for the key).
 *
 * What this module does not do: TLS (put a reverse proxy in front), n > 1 choices,
 * presence / frequency penalties, logprobs of prompt tokens (echo returns them as
 * null), tool calls.
 */
#ifndef LINMOE_SERVER_H
#define LINMOE_SERVER_H

#include "linmoe/serve.h"
#include "linmoe/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *host;         /* address to bind, default "127.0.0.1" (loopback only) */
    int port;                 /* TCP port; 0 = any free one (lm_server_port tells) */
    const char *api_key;      /* NULL or "": no authentication */
    const char *model_name;   /* the id in /v1/models and responses */
    int64_t max_body_bytes;   /* default 1 MiB */
    int64_t max_header_bytes; /* libmicrohttpd's per-connection memory, default 32 KiB */
    int max_json_depth;       /* default 32 */
    int max_connections;      /* default 512 */
    int default_max_tokens;   /* completions without max_tokens (OpenAI: 16) */
    int threads;              /* OpenMP threads of the scheduler thread, which runs the
                                 model (prefills; decode steps with engine.decode_threads
                                 = 1); 0 = lm_get_num_threads() of the caller of
                                 lm_server_start (OpenMP would give the new thread its
                                 default, every core) */
    lm_engine_config engine;
} lm_server_config;

/* 127.0.0.1, port 8080, no key, "linmoe", the limits above, lm_engine_config_default. */
void lm_server_config_default(lm_server_config *c);

typedef struct lm_server lm_server;

/* Start serving model m (borrowed, made for lm_engine_model_tokens(&c->engine) tokens
 * at least) with tokenizer tok (borrowed) on host:port. Returns when the socket
 * listens. Errors: the engine's (config, memory), LM_ERR_IO when the address cannot be
 * bound (names host and port), LM_ERR_INVALID for a bad host or config. */
lm_status lm_server_start(lm_server **out, lm_model *m, lm_tokenizer *tok,
                          const lm_server_config *c, lm_error *err);
/* The port the server listens on. */
int lm_server_port(const lm_server *s);
/* Stop: new requests get 503, running ones are cancelled, connections closed, threads
 * joined, everything freed. */
void lm_server_stop(lm_server *s);

/* The request checks of POST /v1/completions (chat = 0) and /v1/chat/completions
 * (chat = 1) on `len` bytes of body, without a model or a socket: UTF-8, JSON depth,
 * JSON syntax, then every parameter as the server parses it (prompt encoded with tok,
 * token ids checked against vocab, lengths against a context of max_len tokens).
 * Returns the HTTP status the server would answer before queueing (200: accepted,
 * 400, 413, 503). For the fuzz target tests/fuzz (and tests). */
int lm_server_check_request(lm_tokenizer *tok, int vocab, int64_t max_len, int chat,
                            const char *body, size_t len);

/* The chat template for base models (documented in docs/serving.md): for each message
 * "System: ...\n\n", "User: ...\n\n" or "Assistant: ...\n\n" by role, then
 * "Assistant:". Returns a malloc'd string (NULL: out of memory). roles/contents [n]. */
char *lm_chat_template(const char *const *roles, const char *const *contents, int n);

/* Strict UTF-8 validation (no overlong forms, surrogates or code points > U+10FFFF).
 * Returns -1 when valid, else the offset of the first bad byte. */
int64_t lm_utf8_invalid_at(const char *s, size_t n);

#ifdef __cplusplus
}
#endif
#endif
