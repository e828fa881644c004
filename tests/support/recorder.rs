//! A `tracing` subscriber that records every event's fields and every span's name, for the
//! tests of the setup events (src/events.rs's unit tests include this file too).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// One event: its fields as text (`Debug` of each value; strings without quotes).
pub type Fields = BTreeMap<String, String>;

/// What the subscriber saw.
#[derive(Clone, Default)]
pub struct Recorded {
    pub events: Arc<Mutex<Vec<Fields>>>,
    pub spans: Arc<Mutex<Vec<Fields>>>,
}

impl Recorded {
    /// The events whose `decision` field is `decision`.
    pub fn decisions(&self, decision: &str) -> Vec<Fields> {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        events
            .iter()
            .filter(|f| f.get("decision").map(String::as_str) == Some(decision))
            .cloned()
            .collect()
    }
}

struct Visitor<'a>(&'a mut Fields);

impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }
}

struct Recorder(Recorded);

impl<S: tracing::Subscriber> Layer<S> for Recorder {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields::new();
        fields.insert("target".into(), event.metadata().target().to_string());
        event.record(&mut Visitor(&mut fields));
        self.0
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(fields);
    }
    fn on_new_span(&self, attrs: &tracing::span::Attributes<'_>, _: &tracing::span::Id, _: Context<'_, S>) {
        let mut fields = Fields::new();
        fields.insert("name".into(), attrs.metadata().name().to_string());
        attrs.record(&mut Visitor(&mut fields));
        self.0
            .spans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(fields);
    }
}

/// A subscriber that records into the returned `Recorded`.
pub fn subscriber() -> (impl tracing::Subscriber + Send + Sync, Recorded) {
    let recorded = Recorded::default();
    (
        tracing_subscriber::registry().with(Recorder(recorded.clone())),
        recorded,
    )
}
