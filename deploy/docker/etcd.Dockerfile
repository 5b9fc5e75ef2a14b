# etcd for deploy/compose where no registry can be reached: the etcd binary of Debian's
# etcd-server package (it links only libc), copied from the build host by build-image.sh --etcd
# onto kvpool's base. Same path as in quay.io/coreos/etcd, so compose.yaml runs either.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
COPY etcd /usr/local/bin/etcd
RUN install -d -o 10001 -g 10001 -m 700 /var/lib/etcd
USER 10001:10001
EXPOSE 2379 2380
STOPSIGNAL SIGINT
CMD ["/usr/local/bin/etcd"]
