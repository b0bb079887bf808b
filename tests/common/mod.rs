//! What the tests that start `kiln serve` share: the child process with its log, and the wait
//! until it answers.

use std::ffi::OsStr;
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A port nothing listens on now (bound, read, released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `kiln serve --port P --served-model-name bard --kv-cache-memory 8MiB` and `args`, on a free
/// port, once it answers /health: the server, a client (60 s timeout) and its URL.
pub async fn serve<I, S>(args: I) -> (Server, reqwest::Client, String)
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let port = free_port();
    let log = tempfile::NamedTempFile::new().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--port", &port.to_string()])
        .args(["--kv-cache-memory", "8MiB", "--served-model-name", "bard"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .expect("start kiln serve");
    let mut server = Server { child, log };
    let url = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    server.wait_healthy(&client, &url).await;
    (server, client, url)
}

/// A running `kiln serve`, its stderr written to `log`; killed and reaped when dropped.
pub struct Server {
    pub child: Child,
    pub log: tempfile::NamedTempFile,
}

impl Server {
    /// What it has written to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// The exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Waits until `url`/health answers 200, at most 60 s; fails the test, with the server's
    /// log, if it exits first or never answers.
    pub async fn wait_healthy(&mut self, client: &reqwest::Client, url: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = client.get(format!("{url}/health")).send().await
                && r.status() == reqwest::StatusCode::OK
            {
                return;
            }
            assert!(
                self.exited().is_none(),
                "kiln serve exited early:\n{}",
                self.log()
            );
            assert!(
                Instant::now() < deadline,
                "kiln serve never became healthy:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
