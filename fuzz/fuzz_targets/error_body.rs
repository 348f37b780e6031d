//! The error-body classifier on arbitrary bytes and statuses (and, for some, a Bedrock
//! `x-amzn-ErrorType`): never panics, and a 2xx is always a success. Bodies shaped like
//! Google's envelope or Bedrock's are read by the same entry point.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_llm_retry::classify::{Classify, DefaultClassifier};

fuzz_target!(|data: &[u8]| {
    let Some((&code, body)) = data.split_first() else {
        return;
    };
    let status = [200u16, 400, 401, 408, 409, 413, 429, 500, 503, 529][code as usize % 10];
    let aws = [
        "",
        "ThrottlingException",
        "ModelNotReadyException",
        "ValidationException",
    ][(code as usize / 10) % 4];
    let mut head = http::Response::builder().status(status);
    if !aws.is_empty() {
        head = head.header("x-amzn-errortype", aws);
    }
    let head = head.body(()).unwrap().into_parts().0;
    let c = DefaultClassifier::new().classify_response(&head, Some(body));
    assert_eq!(c.is_success(), status == 200);
});
