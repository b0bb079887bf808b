//! What the tests that start `kiln serve` share: the child process with its log, and the wait
//! until it answers.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

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
