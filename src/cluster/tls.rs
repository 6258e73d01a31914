//! Optional TLS on both links of a run that spans processes: mutual TLS 1.3
//! (rustls), every process presenting its certificate and checking the
//! other's against the run's CA. The cookie proof still runs inside it.
//!
//! Membership is the CA's signature: a peer's certificate is checked for its
//! chain to the CA, its validity dates and its key usage, not for a host name.
//! Runs reach each other by IP address (MASTER_ADDR, the roster's listen
//! addresses), so a name check would demand an IP in every certificate and
//! protect nothing more: anyone the CA signed may join a run anyway, as a
//! member — which is why the CA should be one made for the cluster alone.
//!
//! This module owns loading the files (errors name the file and what it
//! should hold), the configs for both links, and the blocking TLS session of
//! a data link, split into a reader and a writer that never wait on each other.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "TLS needs all three of --tls-cert, --tls-key and --tls-ca (or PIPEWRIGHT_TLS_CERT, _KEY and _CA); {given} given, {missing} missing"
    )]
    Partial { given: String, missing: String },
    #[error("{what} {}: cannot read: {error}", path.display())]
    Read { what: String, path: PathBuf, error: io::Error },
    #[error("{what} {}: {why} (expected {expected})", path.display())]
    Pem { what: String, path: PathBuf, why: String, expected: &'static str },
    #[error("{what} {}: {why}", path.display())]
    Invalid { what: String, path: PathBuf, why: String },
}

/// Where this process's certificate, its key and the run's CA are, and
/// which flag or variable named each (for errors).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: (String, PathBuf),
    pub key: (String, PathBuf),
    pub ca: (String, PathBuf),
}

impl TlsFiles {
    /// Flags first, then PIPEWRIGHT_TLS_CERT, _KEY and _CA: all three or none.
    pub fn resolve(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
    ) -> Result<Option<TlsFiles>, TlsError> {
        let pick = |flag: &str, var: &str, given: Option<PathBuf>| match given {
            Some(p) => Some((flag.to_string(), p)),
            None => std::env::var_os(var).filter(|v| !v.is_empty()).map(|p| (var.to_string(), p.into())),
        };
        let cert = pick("--tls-cert", "PIPEWRIGHT_TLS_CERT", cert);
        let key = pick("--tls-key", "PIPEWRIGHT_TLS_KEY", key);
        let ca = pick("--tls-ca", "PIPEWRIGHT_TLS_CA", ca);
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles { cert, key, ca })),
            (cert, key, ca) => {
                let names = ["--tls-cert", "--tls-key", "--tls-ca"];
                let have = [cert.is_some(), key.is_some(), ca.is_some()];
                let list = |want: bool| {
                    let v: Vec<&str> = (0..3).filter(|&i| have[i] == want).map(|i| names[i]).collect();
                    v.join(" and ")
                };
                Err(TlsError::Partial { given: list(true), missing: list(false) })
            }
        }
    }
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, TlsError> {
    crate::fsutil::read_regular(path, crate::fsutil::MAX_SECRET_BYTES, "a certificate or key file may hold")
        .map_err(|error| TlsError::Read { what: what.into(), path: path.into(), error })
}

const CERT_PEM: &str = "PEM blocks \"-----BEGIN CERTIFICATE-----\"";
const KEY_PEM: &str =
    "a PEM \"-----BEGIN PRIVATE KEY-----\" (PKCS#8), \"RSA PRIVATE KEY\" or \"EC PRIVATE KEY\" block";

fn certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(what, path)?;
    let pem = |why: String| TlsError::Pem { what: what.into(), path: path.into(), why, expected: CERT_PEM };
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(format!("not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(pem("no certificate in it".into()));
    }
    Ok(certs)
}

fn key(what: &str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(what, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Pem {
        what: what.into(),
        path: path.into(),
        why: match e {
            rustls::pki_types::pem::Error::NoItemsFound => "no private key in it".into(),
            e => format!("not valid PEM: {e}"),
        },
        expected: KEY_PEM,
    })
}

/// What both links need to speak TLS: a server and a client config, each
/// presenting this process's certificate and demanding the peer's.
#[derive(Clone)]
pub struct Tls {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    files: TlsFiles,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tls({})", self.files.cert.1.display())
    }
}

impl Tls {
    pub fn load(files: &TlsFiles) -> Result<Tls, TlsError> {
        let (cert_what, cert_path) = (&files.cert.0, &files.cert.1);
        let (key_what, key_path) = (&files.key.0, &files.key.1);
        let (ca_what, ca_path) = (&files.ca.0, &files.ca.1);
        let chain = certs(cert_what, cert_path)?;
        let key = key(key_what, key_path)?;
        let mut roots = RootCertStore::empty();
        for c in certs(ca_what, ca_path)? {
            roots.add(c).map_err(|e| TlsError::Invalid {
                what: ca_what.clone(),
                path: ca_path.clone(),
                why: format!("not a usable CA certificate: {e}"),
            })?;
        }
        let roots = Arc::new(roots);
        // Explicit, so no process-wide default provider has to be installed first.
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let pair = |e: rustls::Error| TlsError::Invalid {
            what: format!("{key_what} {} with {cert_what}", key_path.display()),
            path: cert_path.clone(),
            why: format!("cannot use this key and certificate: {e}"),
        };
        // Only pipewright speaks to pipewright: TLS 1.2 would add nothing but ways to misconfigure.
        let versions = &[&rustls::version::TLS13];

        let verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build().map_err(
                |e| TlsError::Invalid { what: ca_what.clone(), path: ca_path.clone(), why: e.to_string() },
            )?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(pair)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(pair)?;
        // Every session is a fresh handshake: links are few and long-lived.
        server.send_tls13_tickets = 0;

        let ca = ClusterCa { roots, algs: provider.signature_verification_algorithms };
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .map_err(pair)?
            .dangerous() // only to check the CA's signature without a host name; see the module header
            .with_custom_certificate_verifier(Arc::new(ca))
            .with_client_auth_cert(chain, key)
            .map_err(pair)?;
        client.enable_sni = false;
        client.resumption = rustls::client::Resumption::disabled();

        Ok(Tls { server: Arc::new(server), client: Arc::new(client), files: files.clone() })
    }

    /// For the cluster node's listener.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.server.clone())
    }

    /// For joining rank 0's cluster node.
    pub fn connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(self.client.clone())
    }

    /// The name a client gives; nothing checks it (see the module header).
    pub fn server_name() -> ServerName<'static> {
        ServerName::try_from("pipewright").expect("a valid DNS name")
    }

    /// Runs the server's handshake on a blocking socket (its read timeout bounds it).
    pub fn accept(&self, sock: &mut TcpStream) -> io::Result<Connection> {
        let conn = ServerConnection::new(self.server.clone()).map_err(io::Error::other)?;
        handshake(conn.into(), sock)
    }

    /// Runs the client's handshake on a blocking socket (its read timeout bounds it).
    pub fn connect(&self, sock: &mut TcpStream) -> io::Result<Connection> {
        let conn =
            ClientConnection::new(self.client.clone(), Tls::server_name()).map_err(io::Error::other)?;
        handshake(conn.into(), sock)
    }
}

fn handshake(mut conn: Connection, sock: &mut TcpStream) -> io::Result<Connection> {
    while conn.is_handshaking() {
        let (read, written) = conn.complete_io(sock)?;
        if read == 0 && written == 0 && conn.is_handshaking() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    // A server's last flight can still be queued once its side is done.
    while conn.wants_write() {
        conn.write_tls(sock)?;
    }
    Ok(conn)
}

/// The TLS error under an I/O error, if that is what it is.
pub fn tls_cause(e: &io::Error) -> Option<&rustls::Error> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

/// Checks a server's certificate chain against the run's CA (and its
/// handshake signatures), but no host name: see the module header.
#[derive(Debug)]
struct ClusterCa {
    roots: Arc<RootCertStore>,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for ClusterCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algs.supported_schemes()
    }
}

// A data link is read by one thread and written by another, each blocking on
// the socket. A TLS session cannot be cloned like the socket, so the two
// halves share it behind one lock and take turns only for the in-memory work
// (decrypting what arrived, encrypting what goes out): the lock is never held
// across a socket read or write, so neither side can wait on the other and a
// full send buffer never stalls receiving (no deadlock when both peers send
// large frames at once). Only the writer puts records on the wire, so they
// leave in the order the session made them. Encryption and decryption do
// serialize on the lock; AES-GCM runs at several GB/s a core, well above
// what the link carries.

fn session_lock(conn: &Mutex<Connection>) -> io::Result<std::sync::MutexGuard<'_, Connection>> {
    conn.lock().map_err(|_| io::Error::other("the TLS session's lock is poisoned"))
}

/// Splits an established session on `sock` into its reading and writing halves.
pub fn split(conn: Connection, sock: &TcpStream) -> io::Result<(TlsReader, TlsWriter)> {
    let conn = Arc::new(Mutex::new(conn));
    let reader = TlsReader {
        conn: conn.clone(),
        sock: sock.try_clone()?,
        raw: vec![0; 1 << 16].into_boxed_slice(),
        start: 0,
        end: 0,
    };
    let writer = TlsWriter { conn, sock: sock.try_clone()?, records: Vec::new() };
    Ok((reader, writer))
}

pub struct TlsReader {
    conn: Arc<Mutex<Connection>>,
    sock: TcpStream,
    /// Bytes from the socket the session has not taken yet: `raw[start..end]`.
    raw: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Read for TlsReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            // Decrypting what arrived and copying it out under one hold of the lock.
            let mut conn = session_lock(&self.conn)?;
            loop {
                match conn.reader().read(out) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    // The peer closed without close_notify. Between frames that is
                    // an ordinary close (only cutting the link, which anyone on the
                    // path can do anyway); inside a frame the frame reader calls it
                    // truncated.
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                    Err(e) => return Err(e),
                }
                if self.start == self.end {
                    break;
                }
                // The session takes a record or so at a time; the rest waits in `raw`.
                self.start += conn.read_tls(&mut &self.raw[self.start..self.end])?;
                conn.process_new_packets().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            }
            drop(conn);
            let n = self.sock.read(&mut self.raw)?;
            if n == 0 {
                // Tells the session the stream ended; its reader then says how.
                let mut conn = session_lock(&self.conn)?;
                conn.read_tls(&mut io::empty())?;
                conn.process_new_packets().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                continue;
            }
            (self.start, self.end) = (0, n);
        }
    }
}

pub struct TlsWriter {
    conn: Arc<Mutex<Connection>>,
    sock: TcpStream,
    /// Records taken from the session, to write once the lock is released.
    records: Vec<u8>,
}

impl Write for TlsWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.records.clear();
        let n = {
            let mut conn = session_lock(&self.conn)?;
            // Whatever the session queued on its own goes first, and its send
            // buffer (64 KiB) is empty before `buf` goes in, so `n` > 0.
            while conn.wants_write() {
                conn.write_tls(&mut self.records)?;
            }
            let n = conn.writer().write(buf)?;
            while conn.wants_write() {
                conn.write_tls(&mut self.records)?;
            }
            n
        };
        self.sock.write_all(&self.records)?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.sock.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::frame::{read_frame, write_frame, Array, Frame};
    use crate::cluster::link::LinkStream;
    use crate::cluster::wire::Kind;
    use std::io::{BufReader, BufWriter};

    fn fixtures() -> Tls {
        let f = |name: &str| {
            let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls").join(name);
            (name.to_string(), p)
        };
        Tls::load(&TlsFiles { cert: f("node.pem"), key: f("node.key"), ca: f("ca.pem") }).unwrap()
    }

    fn pair(tls: &Tls) -> (LinkStream, LinkStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let server = tls.clone();
        let b = std::thread::spawn(move || LinkStream::over_tls(b, &server, false).unwrap());
        let a = LinkStream::over_tls(a, tls, true).unwrap();
        (a, b.join().unwrap())
    }

    #[test]
    fn both_ends_sending_large_frames_at_once_neither_deadlock_nor_lose_a_bit() {
        let (a, b) = pair(&fixtures());
        // Each end's writer pushes far more than the socket buffers hold while
        // its reader drains the other direction: a lock held across a socket
        // call would stall both ends here.
        let frames = 6;
        let payload = |seed: u32| Array::U32((0..(1u32 << 20)).map(|i| i.wrapping_mul(seed)).collect());
        let run = |end: LinkStream, seed: u32| {
            let LinkStream { reader, writer, socket } = end;
            let w = std::thread::spawn(move || {
                let mut w = BufWriter::with_capacity(1 << 16, writer);
                let mut scratch = Vec::new();
                for _ in 0..frames {
                    let f = Frame::with(Kind::Welcome, vec![payload(seed)]);
                    write_frame(&mut w, &f, &mut scratch).unwrap();
                }
                w.flush().unwrap();
            });
            let r = std::thread::spawn(move || {
                let mut r = BufReader::with_capacity(1 << 16, reader);
                (0..frames).map(|_| read_frame(&mut r).unwrap().unwrap()).collect::<Vec<_>>()
            });
            (w, r, socket)
        };
        let (wa, ra, _sa) = run(a, 3);
        let (wb, rb, _sb) = run(b, 7);
        wa.join().unwrap();
        wb.join().unwrap();
        for (got, seed) in [(ra.join().unwrap(), 7), (rb.join().unwrap(), 3)] {
            assert_eq!(got.len(), frames);
            assert!(got.iter().all(|f| f.arrays == vec![payload(seed)]));
        }
    }

    #[test]
    fn a_partial_set_of_files_names_what_is_missing() {
        let e = TlsFiles::resolve(Some("c.pem".into()), None, Some("ca.pem".into())).unwrap_err().to_string();
        assert!(e.contains("--tls-cert and --tls-ca given, --tls-key missing"), "{e}");
    }
}
