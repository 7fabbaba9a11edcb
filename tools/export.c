/* `linmoe export --ckpt DIR --format fla --out DIR`: write a dense linmoe checkpoint
 * as an fla KDAForCausalLM checkpoint (config.json + model.safetensors). The mapping,
 * the refusals and the atomic write are the library's (include/linmoe/export.h); this
 * file only parses the flags and prints a summary. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "linmoe/core.h"
#include "linmoe/export.h"

#define PROG "linmoe export"

void lm_cli_export_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe export --ckpt DIR --format fla --out DIR [--dtype f32|bf16] [--force]\n"
            "                     [--allow-eps-mismatch]\n"
            "\n"
            "Writes the checkpoint DIR (config.json + model.safetensors, or a run directory:\n"
            "its newest checkpoint) in the format of fla's KDAConfig / KDAForCausalLM, so that\n"
            "`KDAForCausalLM.from_pretrained(OUT)` (flash-linear-attention) loads it:\n"
            "OUT/config.json (model_type \"kda\") and OUT/model.safetensors with fla's tensor\n"
            "names (e.g. model.embeddings.weight, model.layers.i.attn.f_proj.0.weight), the\n"
            "short-conv weights as [C, 1, W], and zeros for the gate projection's bias\n"
            "(attn.g_proj.1.bias), which linmoe does not have. The bounded gate becomes\n"
            "safe_gate = true with the same lower_bound, the softplus gate safe_gate = false.\n"
            "\n"
            "Refused, with the config field and value named: MoE layers\n"
            "(first_k_dense_replace < num_hidden_layers), AttnRes residuals, KDA layers with\n"
            "different gates, NoPE attention layers, num_attention_heads * head_dim !=\n"
            "hidden_size, a KDA head_dim above 256, and (with KDA layers) rms_norm_eps other\n"
            "than 1e-5, since fla's KDA output norm shares the model's norm_eps while linmoe's\n"
            "uses 1e-5.\n"
            "\n"
            "options:\n"
            "  --ckpt DIR             linmoe checkpoint or run directory (required)\n"
            "  --format fla           the target format (required; fla is the only one)\n"
            "  --out DIR              output directory (required); written to DIR.tmp.PID and\n"
            "                         renamed; an existing non-empty DIR is refused\n"
            "  --dtype f32|bf16       tensor dtype of the output (default f32)\n"
            "  --force                replace an existing non-empty --out\n"
            "  --allow-eps-mismatch   export rms_norm_eps != 1e-5 anyway (fla's KDA output norm\n"
            "                         then runs at rms_norm_eps instead of 1e-5)\n"
            "  --help                 this help\n"
            "\n"
            "exit status: 0 success, 1 bad input (including a config fla cannot represent),\n"
            "2 usage error\n");
}

int lm_cli_export(int argc, char **argv) {
    /* argv[0] == "export" */
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_export_usage(stdout);
            return LM_EXIT_OK;
        }
    const char *ckpt = NULL, *out = NULL, *format = NULL, *dtype = "f32";
    lm_export_fla_options o;
    lm_export_fla_options_default(&o);
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int r;
#define FLAG(name) ((r = lm_cli_flag_val(PROG, argc, argv, &i, name, &v)) != 0)
        if (FLAG("--ckpt")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            ckpt = v;
        } else if (FLAG("--out")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            out = v;
        } else if (FLAG("--format")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            format = v;
        } else if (FLAG("--dtype")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            dtype = v;
        } else if (strcmp(argv[i], "--force") == 0) {
            o.force = 1;
        } else if (strcmp(argv[i], "--allow-eps-mismatch") == 0) {
            o.allow_eps_mismatch = 1;
        } else {
            fprintf(stderr, PROG ": unknown %s '%s' (see `linmoe export --help`)\n",
                    argv[i][0] == '-' ? "option" : "argument", argv[i]);
            return LM_EXIT_USAGE;
        }
#undef FLAG
    }
    if (!ckpt || !out || !format) {
        fprintf(stderr, PROG ": --ckpt, --format and --out are required (see `linmoe export "
                             "--help`)\n");
        return LM_EXIT_USAGE;
    }
    if (strcmp(format, "fla") != 0) {
        fprintf(stderr, PROG ": --format '%s' (the only format is fla)\n", format);
        return LM_EXIT_USAGE;
    }
    if (strcmp(dtype, "f32") == 0 || strcmp(dtype, "fp32") == 0) {
        o.dtype = LM_F32;
    } else if (strcmp(dtype, "bf16") == 0) {
        o.dtype = LM_BF16;
    } else {
        fprintf(stderr, PROG ": --dtype '%s' (want f32 or bf16)\n", dtype);
        return LM_EXIT_USAGE;
    }
    char dir[4096];
    char why[4200];
    if (lm_cli_resolve_ckpt_why(ckpt, dir, sizeof dir, why, sizeof why) != 0) {
        fprintf(stderr, PROG ": %s\n", why);
        return LM_EXIT_BAD_INPUT;
    }
    lm_error err = {0};
    if (lm_export_fla(dir, out, &o, &err) != LM_OK) {
        static const char lib_prefix[] = "export --format fla: ";
        const char *msg = err.msg;
        if (strncmp(msg, lib_prefix, sizeof lib_prefix - 1) == 0)
            msg += sizeof lib_prefix - 1;
        fprintf(stderr, PROG " --format fla: %s: %s\n", dir, msg);
        return LM_EXIT_BAD_INPUT;
    }
    printf("exported %s to %s (fla KDAForCausalLM, %s): config.json, model.safetensors\n", dir, out,
           o.dtype == LM_BF16 ? "bf16" : "f32");
    return LM_EXIT_OK;
}
