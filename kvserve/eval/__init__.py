"""`kvserve eval`: what a lossy KV configuration costs against the lossless run of the same engine."""
