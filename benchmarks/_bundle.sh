# Sourced by gpu_session.sh and fast_gpu.sh: the device tool brings back at most 8 files, so on
# exit everything under $OUT goes back as one archive, $OUT/logs.tgz.
bundle() {
  (cd "$OUT" && ls | grep -q . && tar czf /tmp/logs.tgz --exclude=logs.tgz . && rm -rf ./* \
    && mv /tmp/logs.tgz logs.tgz) || true
}
trap bundle EXIT
