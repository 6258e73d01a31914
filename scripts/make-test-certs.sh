#!/bin/sh
# Writes the TLS fixtures of tests/multiprocess.rs into tests/fixtures/tls/,
# with the same openssl commands as the recipe in docs/guide/clusters.md
# ("TLS"), so the tests also check that what the recipe makes is what rustls
# accepts.
#
#   ca.pem                 the run's CA
#   node.pem, node.key     a process's certificate (signed by ca.pem) and key
#   rogue.pem, rogue.key   a certificate from another CA, which a run refuses
#
# The CA keys are thrown away: the tests need none. Valid for 100 years so
# the fixtures never expire under CI.
set -eu
out=$(cd "$(dirname "$0")/.." && pwd)/tests/fixtures/tls
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
days=36500

ca() { # name
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days $days \
        -subj "/CN=$1" -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -keyout "$tmp/$1.key" -out "$tmp/$1.pem" 2>/dev/null
}

node() { # ca-name cert-name
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
        -keyout "$out/$2.key" -out "$tmp/$2.csr" 2>/dev/null
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:%s,IP:127.0.0.1\n' "$2" > "$tmp/$2.ext"
    openssl x509 -req -in "$tmp/$2.csr" -CA "$tmp/$1.pem" -CAkey "$tmp/$1.key" -CAcreateserial \
        -days $days -extfile "$tmp/$2.ext" -out "$out/$2.pem" 2>/dev/null
}

ca cluster
ca elsewhere
cp "$tmp/cluster.pem" "$out/ca.pem"
node cluster node
node elsewhere rogue
chmod 600 "$out"/*.key
echo "wrote $(ls "$out" | tr '\n' ' ')to $out"
