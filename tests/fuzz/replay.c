/* Corpus replay (CTest fuzz_corpus_replay, the normal gcc build): every file of
 * tests/fuzz/corpus/<target>/ through that target's entry function, so a crash the
 * fuzzer found (committed there as its reproducer) is caught without clang.
 *   fuzz_replay [CORPUS_ROOT]          all targets (default tests/fuzz/corpus)
 *   fuzz_replay TARGET FILE...         given files through one target
 *   fuzz_replay --write-seeds DIR      write the seeds made by linmoe's own writers
 *                                      (train_state, shard) into DIR/<target>/
 * Exit 0 when every input ran (a crash aborts); 1 when a target has no corpus. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/shard.h"
#include "targets.h"

int lm_fuzz_write_train_state(const char *run_dir, char *dir, size_t size);

static int write_seeds(const char *root) {
    char run[1024], dir[1200], cmd[4096];
    snprintf(run, sizeof run, "%s/.seed-run", root);
    snprintf(cmd, sizeof cmd, "mkdir -p %s", run);
    if (system(cmd) != 0 || lm_fuzz_write_train_state(run, dir, sizeof dir) != 0)
        return 1;
    snprintf(cmd, sizeof cmd,
             "mkdir -p %s/train_state && cp %s/train_state.safetensors "
             "%s/train_state/micro-step3.safetensors && rm -rf %s",
             root, dir, root, run);
    if (system(cmd) != 0)
        return 1;
    snprintf(cmd, sizeof cmd, "mkdir -p %s/shard", root);
    if (system(cmd) != 0)
        return 1;
    int32_t tok[40];
    for (int i = 0; i < 40; i++)
        tok[i] = (i * 37) % 257;
    char path[1200];
    snprintf(path, sizeof path, "%s/shard/byte-40.tokens", root);
    if (lm_shard_write(path, 257, tok, 40, NULL) != LM_OK)
        return 1;
    for (int i = 0; i < 20; i++)
        tok[i] = (i * 7919) % 50257;
    snprintf(path, sizeof path, "%s/shard/gpt2-20.tokens", root);
    if (lm_shard_write(path, 50257, tok, 20, NULL) != LM_OK)
        return 1;
    for (int i = 0; i < 20; i++)
        tok[i] = 70000 + i;
    snprintf(path, sizeof path, "%s/shard/wide-20.tokens", root);
    if (lm_shard_write(path, 100000, tok, 20, NULL) != LM_OK)
        return 1;
    return 0;
}

static int run_file(const lm_fuzz_target *t, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz_replay: cannot open %s\n", path);
        return -1;
    }
    size_t cap = 4096, n = 0;
    unsigned char *b = malloc(cap);
    size_t r;
    while (b && (r = fread(b + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap)
            b = realloc(b, cap *= 2);
    }
    fclose(f);
    if (!b)
        return -1;
    /* an exact-size copy so ASan sees reads past the input */
    unsigned char *e = malloc(n ? n : 1);
    memcpy(e, b, n);
    free(b);
    t->run(e, n);
    free(e);
    return 0;
}

static int cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--write-seeds") == 0)
        return write_seeds(argv[2]);
    if (argc >= 3) {
        const lm_fuzz_target *t = lm_fuzz_find(argv[1]);
        if (!t) {
            fprintf(stderr, "fuzz_replay: no target '%s'\n", argv[1]);
            return 2;
        }
        for (int i = 2; i < argc; i++)
            if (run_file(t, argv[i]) != 0)
                return 1;
        return 0;
    }
    const char *root = argc == 2 ? argv[1] : "tests/fuzz/corpus";
    int bad = 0;
    for (int k = 0; k < lm_fuzz_n_targets; k++) {
        const lm_fuzz_target *t = &lm_fuzz_targets[k];
        if (!t->available()) {
            printf("%-16s skipped (not available: data/gpt2 missing?)\n", t->name);
            continue;
        }
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/%s", root, t->name);
        DIR *dp = opendir(dir);
        if (!dp) {
            fprintf(stderr, "fuzz_replay: %s: no corpus directory\n", dir);
            bad = 1;
            continue;
        }
        char **names = NULL;
        int nn = 0;
        struct dirent *de;
        while ((de = readdir(dp)))
            if (de->d_name[0] != '.') {
                names = realloc(names, sizeof(char *) * (size_t)(nn + 1));
                names[nn++] = strdup(de->d_name);
            }
        closedir(dp);
        qsort(names, (size_t)nn, sizeof(char *), cmp);
        for (int i = 0; i < nn; i++) {
            char path[2048];
            snprintf(path, sizeof path, "%s/%s", dir, names[i]);
            if (run_file(t, path) != 0)
                bad = 1;
            free(names[i]);
        }
        free(names);
        printf("%-16s %d inputs\n", t->name, nn);
        if (nn == 0)
            bad = 1;
    }
    return bad;
}
