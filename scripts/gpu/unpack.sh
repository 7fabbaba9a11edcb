# Sourced on the GPU machine from the repository root, first thing in a device call's command
# (scripts/gpu/carry.sh made the archives here): unpacks every gpu-carry/*.tar.gz except the
# main job's (scripts/main-job-gpu.sh run unpacks that itself) and sources
# scripts/gpu/libpath.sh, so build-gpu/ binaries, data/ and peers/fla are in place:
#   source scripts/gpu/unpack.sh && build-gpu/test_gpu_model && scripts/gpu/fla_parity.sh
for lm_carry_f in gpu-carry/*.tar.gz; do
    [ -f "$lm_carry_f" ] || continue
    [ "$(basename "$lm_carry_f")" = main-job.tar.gz ] && continue
    tar -xzf "$lm_carry_f" || echo "unpack.sh: $lm_carry_f: tar failed" >&2
done
unset lm_carry_f
# shellcheck source=scripts/gpu/libpath.sh
source scripts/gpu/libpath.sh
