//! The certificate authority and server certificate a TLS mock serves with.

use std::io;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

use super::Protocol;

/// What a TLS mock serves with and hands to its clients.
pub(super) struct Tls {
    pub(super) ca_pem: String,
    pub(super) ca_der: CertificateDer<'static>,
    pub(super) acceptor: TlsAcceptor,
}

/// The host names the server certificate is valid for.
const NAMES: [&str; 2] = ["localhost", "127.0.0.1"];

/// `ring`, named explicitly so that no process-wide default provider has to
/// be installed, whatever else the process links.
pub(super) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Tls {
    /// A fresh certificate authority, and a server certificate it signed for
    /// `localhost` and `127.0.0.1`, offering the ALPN ids `protocol` allows.
    pub(super) fn generate(protocol: Protocol) -> io::Result<Tls> {
        // A real chain rather than one self-signed leaf: clients then verify
        // the server exactly as they verify a provider's certificate.
        let mut ca_params = CertificateParams::new(Vec::new()).map_err(io::Error::other)?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "tower-llm-retry mock CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().map_err(io::Error::other)?;
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key).map_err(io::Error::other)?;

        let mut leaf_params =
            CertificateParams::new(NAMES.map(String::from).to_vec()).map_err(io::Error::other)?;
        leaf_params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        leaf_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf_key = KeyPair::generate().map_err(io::Error::other)?;
        let leaf = leaf_params
            .signed_by(&leaf_key, &ca)
            .map_err(io::Error::other)?;

        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(io::Error::other)?
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone(), ca.der().clone()], key)
            .map_err(io::Error::other)?;
        config.alpn_protocols = match protocol {
            Protocol::Http1 => vec![b"http/1.1".to_vec()],
            Protocol::Http2 => vec![b"h2".to_vec()],
            Protocol::Auto => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        };

        Ok(Tls {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    pub(super) fn root_store(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.ca_der.clone())
            .expect("a certificate rcgen made parses");
        roots
    }

    pub(super) fn client_config(&self) -> ClientConfig {
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("the ring provider supports the default versions")
            .with_root_certificates(self.root_store())
            .with_no_client_auth()
    }
}
