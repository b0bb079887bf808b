//! [`drive`]: the one loop that runs an engine. `kiln generate --prompts-file`, the chapter's
//! benchmark and chapter 8's server each plug in an [`EngineClient`]: where requests come from
//! (a file, a timed workload, HTTP handlers) and where the tokens go.
//!
//! ```text
//! loop {
//!     client.poll(engine)            add and abort requests; block while the engine is idle
//!     one step, if anything is unfinished
//!     client.on_step(engine, outputs)
//!     finished requests are taken out of the engine
//! }
//! ```

use std::ops::ControlFlow;

use crate::engine::{Engine, EngineError, RequestOutput};
use crate::request::Status;

/// What feeds an engine and receives what it produces.
pub trait EngineClient {
    /// Called before every step: add and abort requests (an aborted request must also be
    /// [`take`](Engine::take)n here, or its record stays until the end). When the engine has
    /// nothing unfinished, this must add work, block until there is some, or break: `drive`
    /// would otherwise spin. `Break` ends the loop.
    fn poll(&mut self, engine: &mut Engine<'_>) -> ControlFlow<()>;

    /// What one step produced, per request. Requests that finished, in the engine or because
    /// this call aborted them, are taken out of the engine when it returns.
    fn on_step(&mut self, engine: &mut Engine<'_>, outputs: Vec<RequestOutput>);
}

// ANCHOR: drive
/// Runs `engine` for `client` until the client breaks. An engine error ends the loop; what
/// was in flight stays in the engine for the caller to fail or abort.
pub fn drive(engine: &mut Engine<'_>, client: &mut dyn EngineClient) -> Result<(), EngineError> {
    while client.poll(engine).is_continue() {
        if !engine.has_unfinished() {
            continue;
        }
        let outputs = engine.step_or_stall()?;
        let ids: Vec<_> = outputs.iter().map(|o| o.id).collect();
        client.on_step(engine, outputs);
        for id in ids {
            if let Some(Status::Finished(_)) = engine.scheduler().status(id) {
                engine.take(id);
            }
        }
    }
    Ok(())
}
// ANCHOR_END: drive
